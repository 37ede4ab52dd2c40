#pragma once
// Schedule synthesis: a schedule made for given costs and a memory budget, instead of chosen from a fixed menu.
// Per backward it decides fused B or I + W, orders every rank's actions and places the W's in the gaps; the result
// is an ordinary Schedule (validate(), simulate(), the Pipeline run it like any other). A generator like the others,
// driven by costs (SynthesizedScheduleGenerator: the registry's "synth"); the planners (twobp/plan/) feed it
// measured ones. (In twobp/plan/synthesize.h before 0.2.0, which still includes this header.)
//
//   twobp::SynthesisProblem problem;
//   problem.ranks = 4;
//   problem.micro_batches = 8;
//   problem.placement = twobp::SynthesisPlacement::kV;   // 2 chunks per rank, zb-v's placement
//   problem.costs = costs;                                // per stage (CostModel), e.g. measured
//   twobp::Schedule schedule = twobp::synthesize_schedule(problem);
//
// The method, its cost and how close it lands to a lower bound: docs/PERFORMANCE.md, "Synthesized schedules".

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"

namespace twobp {

/// Where the stages go. kLinear: one stage per rank (v = 1), stage s on rank s. kInterleaved: v chunks per rank,
/// stage s on rank s % p (interleaved-1f1b's). kV: 2 chunks per rank, stage s on rank s for s < p, else on rank
/// 2p-1-s (zb-v's).
enum class SynthesisPlacement { kLinear, kInterleaved, kV };

/// "linear", "interleaved" or "v".
const char* to_string(SynthesisPlacement placement);

/// stage_to_rank of `placement` for `ranks` ranks and `chunks_per_rank` chunks (read only by kInterleaved; kLinear
/// has 1 and kV 2). Throws ScheduleError for ranks < 1 or chunks_per_rank < 1.
std::vector<int> synthesis_placement(SynthesisPlacement placement, int ranks, int chunks_per_rank);

/// What to synthesize a schedule for.
struct SynthesisProblem {
  int ranks = 2;
  int micro_batches = 4;
  SynthesisPlacement placement = SynthesisPlacement::kV;
  int chunks_per_rank = 2;  ///< v of kInterleaved (>= 1); kLinear and kV fix their own
  /// Per-stage costs (the simulator's, twobp/schedule/simulate.h). Empty `forward`: the textbook F = I = W = 1,
  /// B = 2 on every stage, no communication time (per_action kept). Overlapped pairs and data-parallel reductions
  /// are not searched for (the result has no pairs); recompute, backward_weight_fixed and per_action (each action's
  /// fixed cost, charged as simulate() charges it) are taken into account.
  CostModel costs;
  /// Most (chunk, micro-batch) activations alive at once on any rank, as simulate() counts them
  /// (SimulationResult::peak_live_micro_batches: from the start of an F to the end of its B or W). 0: 1F1B
  /// standard's peak in chunks, v * min(p, m) (min(p, m) stages). At least v (a micro-batch must pass all of a
  /// rank's chunks): synthesize() throws ScheduleError below that, and for a negative budget.
  int memory_budget = 0;
  /// kSplit: each backward is fused B or I + W, whichever makes the faster schedule; kStandard: every backward B.
  BackwardMode backward = BackwardMode::kSplit;
};

/// How hard synthesize() searches. Deterministic: the same problem and options give the same schedule.
struct SynthesisOptions {
  /// Upper bound on the search's work: the sum over the orders it evaluates (list schedules, local-search moves)
  /// of their number of compute actions. One evaluation costs some 20-30 ns per action, so the default is about
  /// half a second; p = 4, m = 8 on the V (192 actions) gets about 100 000 evaluations.
  std::int64_t max_work = 20'000'000;
  /// Also start from every built-in generator's schedule of the same placement within the budget (both backward
  /// forms), so that the result is never slower than the best of them.
  bool from_generators = true;

  /// The planners' search (rank_schedules, plan_llama_layouts): a tenth of the default, as they synthesize once per
  /// mode and layout they rank.
  static SynthesisOptions planning() {
    SynthesisOptions o;
    o.max_work = 2'000'000;
    return o;
  }
};

/// A synthesized schedule and how it was found.
struct SynthesisResult {
  Schedule schedule;          ///< named "synth"; validated, pairs in order per channel
  SimulationResult simulated;  ///< simulate(schedule, costs)
  /// Where the winning order came from: "list scheduling" or "<generator> <standard|2bp>", with " + local search"
  /// and " + iterated local search" when those improved it.
  std::string origin;
  int evaluations = 0;       ///< orders evaluated
  int memory_budget = 0;     ///< the budget used (SynthesisProblem::memory_budget, or its default)
  /// A lower bound on any schedule's step time under the costs, whatever the memory (docs/PERFORMANCE.md): the
  /// busiest rank's work with each backward as the cheaper of B and I + W, plus the time before its first input
  /// can arrive; at least one micro-batch's F's and backwards one after the other.
  double lower_bound = 0.0;
};

/// Synthesizes a schedule for `problem`. Throws ScheduleError when the problem cannot be honoured (ranks or
/// micro-batches < 1, a negative budget or one below v), UsageError when `costs` do not cover the placement's stages,
/// or a cost is NaN, infinite or negative (naming the CostModel member and stage, as simulate()). A B below I is
/// taken (a what-if: where splitting cannot pay); costs a user states through CostSource are held to B >= max(I, W).
SynthesisResult synthesize(const SynthesisProblem& problem, const SynthesisOptions& options = {});

/// synthesize(problem, options).schedule.
Schedule synthesize_schedule(const SynthesisProblem& problem, const SynthesisOptions& options = {});

/// The placements a generator tries for v chunks per rank, in order: v = 1 kLinear; v = 2 kV, then kInterleaved;
/// v >= 3 kInterleaved.
std::vector<SynthesisPlacement> synthesis_placements(int chunks_per_rank);

/// The registry's "synth" schedule (twobp/schedule/registry.h), and a generator to build with other costs: for
/// ScheduleOptions{p, m, v, backward} it synthesizes on each of synthesis_placements(v) and keeps the fastest
/// (the first of equals), with the costs `costs_for` gives for the placement's stage_to_rank (the default: the
/// textbook RankCosts{}), the memory budget `memory_budget_per_rank` * v (in a whole rank's micro-batch
/// activations; 0: 1F1B standard's, min(p, m)) and `options`.
class SynthesizedScheduleGenerator : public ScheduleGenerator {
 public:
  using CostsFor = std::function<CostModel(const std::vector<int>& stage_to_rank)>;

  explicit SynthesizedScheduleGenerator(RankCosts costs = {}, int memory_budget_per_rank = 0,
                                        SynthesisOptions options = {});
  SynthesizedScheduleGenerator(CostsFor costs_for, int memory_budget_per_rank, SynthesisOptions options);
  std::string name() const override { return "synth"; }
  Schedule generate(const ScheduleOptions& options) const override;

  /// Like generate(), with how the kept schedule was found. A non-empty `only_stage_to_rank` restricts the search
  /// to the placement with that stage_to_rank (ScheduleError when none of synthesis_placements(v) has it).
  SynthesisResult synthesize(const ScheduleOptions& options, const std::vector<int>& only_stage_to_rank = {}) const;

 private:
  CostsFor costs_for_;
  int memory_budget_per_rank_;
  SynthesisOptions options_;
};

/// The schedule `name` makes for `options` (make_schedule), except "synth", which is synthesized for the costs
/// `costs_for` gives (a planner's measured or estimated ones; the registry's synth knows only the textbook costs)
/// within 1F1B's memory, on the placement `only_stage_to_rank` when it is not empty. Throws as make_schedule and
/// SynthesizedScheduleGenerator::synthesize.
Schedule make_schedule_for_costs(const std::string& name, const ScheduleOptions& options,
                                 const SynthesizedScheduleGenerator::CostsFor& costs_for,
                                 const SynthesisOptions& synthesis = {},
                                 const std::vector<int>& only_stage_to_rank = {});

}  // namespace twobp
