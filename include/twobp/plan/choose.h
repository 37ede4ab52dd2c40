#pragma once
// The schedule chosen at run time from the run's own costs: measure → plan → run inside one training job.
//
//   twobp::AutoScheduleOptions o;                      // candidates: every registered schedule of the placement
//   o.replicas = groups.data_parallel();               // dp > 1: every replica makes the same choice
//   twobp::AutoSchedule chooser(pipeline, o);
//   for (int step = 0; step < steps; ++step) {
//     twobp::StepResult r = pipeline.step(x, y);
//     if (auto news = chooser.after_step(r)) print(*news);   // collective on the steps where it decides
//     optimizer.step();
//   }
//
// AutoSchedule probes the starting schedule's forms for a few steps each, ranks every registered schedule × mode of
// the same placement by its simulated step time under the costs the ranks agreed on (rank_schedules), runs the
// fastest few predictions and keeps the fastest measured. Every decision comes from all-reduced numbers, so every
// rank decides alike. How the probes work (both modes, W's in two sizes, memory limits, recomputation, overlapped
// pairs) and what is left out (other placements; pipelines whose runtime bounds memory, refused):
// docs/USAGE.md, "Measured costs and the schedule chosen at run time".

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "twobp/plan/measure.h"
#include "twobp/plan/recompute.h"
#include "twobp/plan/trials.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/synthesize.h"

namespace twobp {

/// A schedule the running pipeline could switch to, and its step time under measured costs.
struct ScheduleCandidate {
  std::string name;  ///< registry name
  BackwardMode mode = BackwardMode::kSplit;
  Schedule schedule;
  double predicted_ms = 0.0;  ///< simulate(schedule, costs).step_time
  /// max over ranks of simulate_peak_memory(schedule, memory) (bytes); 0 when ranked without a memory model.
  double predicted_peak_bytes = 0.0;
  /// The pipeline ranks whose stages recompute their activations (AutoScheduleOptions::recompute), ascending; the
  /// others run as the pipeline was built. Empty: every stage as built; every rank: every stage.
  std::vector<int> recompute_ranks;
};

/// What rank_schedules considers besides the costs.
struct RankOptions {
  std::vector<std::string> names;  ///< registered schedules (empty: all)
  std::vector<BackwardMode> modes = {BackwardMode::kStandard, BackwardMode::kSplit};
  /// The measured memory model (agree_memory); with it every candidate gets its predicted peak.
  const MemoryModel* memory = nullptr;
  /// With `memory`: candidates whose predicted peak exceeds this on some rank are left out. 0: no limit.
  double memory_limit_bytes = 0.0;
  /// Costs measured with every stage recomputing (and, with `memory`, the memory model so measured). Given, the
  /// candidates are also every form with the first 1 .. num_ranks ranks of recompute_order recomputing (by the
  /// form's peaks under `memory`; by rank without it), whose stages on the recomputing ranks take these costs and
  /// memory, the others `costs` and `memory`. nullptr: no recomputing candidates.
  const MeasuredCosts* recompute_costs = nullptr;
  const MemoryModel* recompute_memory = nullptr;
  /// The search of `synth`, synthesized for each mode's measured costs on the running placement
  /// (make_schedule_for_costs).
  SynthesisOptions synthesis = SynthesisOptions::planning();
};

/// The registered schedules × modes (`names` / `modes`; empty `names`: every registered schedule) that keep
/// `running`'s placement (num_ranks, num_stages, stage_to_rank) and micro-batch count, ranked by their simulated
/// step time under `costs` (fastest first; exact ties in registry order whatever the order of RankOptions::names
/// and modes, standard before 2BP, then fewer recomputing ranks; with RankOptions::recompute_costs each form once
/// per recompute_ranks setting). The costs of the
/// measured stages carry over unchanged, the placement being the same. A standard candidate's fused B is the
/// measured B where the run had one, else I + W (2BP's split costs the same work); a 2BP candidate needs I and W,
/// so costs of a standard run rank the standard forms only. Generators that reject the shape are left out, and so
/// are candidates over the memory limit (RankOptions). Throws UsageError when a name is not registered or `modes`
/// is empty (never read as "no candidate faster"), the memory model does not cover the placement, a limit is given
/// without one (or is NaN), the recomputing costs are of other stages, `memory` is given with recompute_costs but
/// without recompute_memory, or `costs` or recompute_costs are refused by check_measured_costs (a NaN, infinite,
/// negative or huge cost: "rank_schedules: costs: costs_ms.F[0] is nan, ...").
std::vector<ScheduleCandidate> rank_schedules(const Schedule& running, const MeasuredCosts& costs,
                                              const RankOptions& options = {});

struct AutoScheduleOptions {
  /// Steps measured with each probed form before choosing; the first is left out (warm-up). >= 2.
  int probe_steps = 4;
  /// Steps each measured candidate runs; the first is left out. >= 2.
  int verify_steps = 4;
  /// How many of the fastest predicted candidates are measured (>= 1), and how far their prediction may be from
  /// the best prediction (and from the starting schedule's): 0.10 = within 10 %.
  int measure_candidates = 3;
  double measure_within = 0.10;
  /// Candidate names (empty: every registered schedule) and modes; an unregistered name or no mode is refused
  /// (UsageError, at construction).
  std::vector<std::string> names;
  std::vector<BackwardMode> modes = {BackwardMode::kStandard, BackwardMode::kSplit};
  /// Per-rank bound on the candidates' simulated peak tensor memory (bytes; 0: none). Needs the pipeline to run
  /// with ExecutorOptions::record_memory (on CPU also memory::count_cpu_allocations(), twobp/metrics/memory.h).
  double memory_limit_bytes = 0.0;
  /// Also the forms with the stages of 1 .. num_ranks ranks recomputing (docs/USAGE.md). The probe then
  /// runs each starting form again with every stage recomputing, probe_steps steps each (4 probes instead of 2
  /// where both modes are candidates). Meant for a pipeline built without recomputation (one built with it on every
  /// stage gets the same forms num_ranks + 1 times).
  bool recompute = false;
  /// Also probe the 2BP form with each of its batched W's run one micro-batch at a time (probe_steps more steps;
  /// docs/USAGE.md), so that the W's fixed part is measured. Worth it where batching W's is cheaper per micro-batch
  /// (GPUs: fewer, larger GEMMs); nothing is added when the 2BP form runs no W of several micro-batches, or `modes`
  /// has no 2BP. Not for the recomputing probes (a W runs no forward again, so its costs are the same).
  bool probe_weight_sizes = false;
  /// Data parallelism: the rank's data-parallel group, so that the replicas agree (collective over it too).
  Transport* replicas = nullptr;
  Duration timeout = std::chrono::minutes(5);
};

/// See the top of this file and docs/USAGE.md. One per rank, beside its Pipeline (which must outlive it). Not
/// thread-safe.
class AutoSchedule {
 public:
  enum class Phase { kProbing, kVerifying, kDone };

  /// Throws UsageError when the options are out of range, the pipeline bounds memory (ExecutorOptions::
  /// memory_limit_bytes, max_pending_weight_micro_batches: the W's such a bound moves are not simulated; bound the
  /// candidates with AutoScheduleOptions::memory_limit_bytes instead), or a memory limit is asked of a pipeline that
  /// does not record memory.
  AutoSchedule(Pipeline& pipeline, AutoScheduleOptions options);

  /// Call after every Pipeline::step() with its result, on every rank. Collective (a few all-reduces over the
  /// pipeline and the replicas) on the step that ends the probe and on the steps that end each candidate's
  /// measurement; a no-op once done. Returns what it decided on those steps (one line, the same on every rank),
  /// else nullopt. Steps until done: probe_steps × (forms probed: 1 or 2, twice that with recompute, one more with
  /// probe_weight_sizes) + verify_steps × (candidates measured, at most measure_candidates).
  std::optional<std::string> after_step(const StepResult& result);

  Phase phase() const { return phase_; }
  /// The candidates of the last ranking, fastest first (empty before the probe ends).
  const std::vector<ScheduleCandidate>& ranking() const { return ranking_; }
  /// The per-stage costs the ranking was made from: the probes as the pipeline was built (F; I and W from the 2BP
  /// form, B from the standard one, where those were probed), agreed over the ranks and the replicas, so the same
  /// on every rank (empty before the probe ends). E.g. for fitting the costs of another placement
  /// (twobp/plan/llama.h), which this class does not switch to.
  const MeasuredCosts& measured_costs() const { return measured_; }
  /// The schedule the pipeline started with, and its measured step time (slowest rank's median, ms; 0 before).
  const Schedule& starting_schedule() const { return start_; }
  double starting_ms() const { return probe_ms_.empty() ? 0.0 : probe_ms_.front(); }
  /// The forms probed (the starting schedule, then its other form when the candidates include that mode, the 2BP
  /// form followed by its W's one micro-batch at a time with AutoScheduleOptions::probe_weight_sizes; with
  /// AutoScheduleOptions::recompute the forms again with every stage recomputing) and their measured step times so
  /// far. Each probe's `predicted_ms` and `predicted_peak_bytes` are set once the probe ends (0 before).
  const std::vector<ScheduleCandidate>& probes() const { return probes_; }
  const std::vector<double>& probe_ms() const { return probe_ms_; }
  /// The candidates measured after the probe (fastest predicted first) and their measured step times so far.
  const std::vector<ScheduleCandidate>& trials() const { return trials_; }
  const std::vector<double>& trial_ms() const { return trial_ms_; }
  /// The final choice's measured step time (the starting schedule's when kept; 0 before done).
  double chosen_ms() const { return chosen_ms_; }
  /// The ranks that run every stage with recomputation now (a recomputing probe or candidate, or the choice;
  /// ascending; empty: every stage as built). The same on every rank.
  const std::vector<int>& recompute_ranks() const { return recompute_ranks_; }
  /// Whether this rank's stages all recompute now (this rank is among recompute_ranks()).
  bool recomputing() const { return has_rank(recompute_ranks_, pipeline_.rank()); }

 private:
  std::string end_probe();     // ranks, shortlists, starts the first trial
  std::string end_trial();     // records a trial; starts the next or settles
  std::string settle(const std::string& prefix);  // keeps the fastest measured; done
  void start_phase(const ScheduleCandidate& next);  // switches the schedule and the recomputation
  void set_recompute(const std::vector<int>& ranks);  // the stages of `ranks` recompute, the others as built
  std::string memory_note() const;

  Pipeline& pipeline_;
  AutoScheduleOptions options_;
  Trial trial_;  // the running probe's or candidate's measurement
  Schedule start_;
  Phase phase_ = Phase::kProbing;
  // [0]: the probes as the pipeline was built, [1]: with every stage recomputing (AutoScheduleOptions::recompute).
  std::vector<CostRecorder> costs_;
  std::vector<MemoryRecorder> memory_;  // with a memory limit
  std::vector<std::pair<int, bool>> built_recompute_;  // this rank's stages as built: (stage, recompute)
  std::vector<int> recompute_ranks_;
  std::vector<ScheduleCandidate> ranking_;
  MeasuredCosts measured_;  // the probes' agreed costs as built
  std::vector<ScheduleCandidate> probes_;
  std::vector<double> probe_ms_;
  std::vector<bool> probe_fits_;  // within the memory limit (all, without one)
  std::size_t weight_probe_ = static_cast<std::size_t>(-1);  // index in probes_ of the W-size probe (none: -1)
  std::vector<ScheduleCandidate> trials_;
  std::vector<double> trial_ms_;
  double chosen_ms_ = 0.0;
};

}  // namespace twobp
