#pragma once
// Other placements at run time: the "plan" and "run" of measure → plan → run beyond one placement. After
// AutoSchedule (plan/choose.h) has chosen among the forms of the starting placement, rank_llama_placements fits
// per-chunk costs to its probes and ranks the forms of other placements (chunks per rank, order of stages on the
// ranks); PlacementSearch measures the fastest predicted few with the trial loop (plan/trials.h) and keeps the
// fastest measured. The program supplies one thing: the move to another placement (checkpoint the state by name,
// build the new chunks, Pipeline and optimizer, load the state).
//
//   twobp::PlacementSearch search(pipeline, current, chooser.chosen_ms(), rebuild, options);
//   print(search.start(twobp::rank_llama_placements(config, current, chooser.measured_costs(), plan_options)));
//   while (!search.done()) { StepResult r = search.pipeline().step(x, y); if (auto n = search.after_step(r)) ...; }

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "twobp/models/llama.h"
#include "twobp/plan/choose.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/trials.h"
#include "twobp/precision.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/schedule.h"

namespace twobp {

/// A model's stages on a pipeline's ranks and the form that runs them.
struct Placement {
  Schedule schedule;                 ///< its stage_to_rank is the placement; its name and mode the form
  models::Partition partition;       ///< the layers of each stage
  std::vector<int> recompute_ranks;  ///< pipeline ranks whose stages recompute (ascending; empty: none)
};

/// Whether `a` and `b` put the same stages (chunks of the same layers) on the same ranks: a job moves between them
/// by switching the schedule and the recomputation; otherwise its state moves.
bool same_placement(const Placement& a, const Placement& b);
/// "interleaved-1f1b 2bp (2 chunk(s) per rank, layers 1,1,1,1)", and " recomputing on ranks 0,1" where some do.
std::string describe(const Placement& p);

/// A placement's form and its predicted step time (ms).
struct PlacementCandidate {
  Placement placement;
  double predicted_ms = 0;
};
struct PlacementRanking {
  double current_ms = 0;                   ///< the current form under the same fitted costs
  std::vector<PlacementCandidate> others;  ///< the other placements' forms that fit, fastest predicted first
  std::string fit;                         ///< how the costs were fitted (LlamaCosts::how)
  std::string why_none;                    ///< when `others` is empty
};

/// What rank_llama_placements considers besides the costs: the run's sizes and what bounds the forms.
struct PlacementPlanOptions {
  int64_t micro_batch_size = 1;
  int64_t seq = 0;
  Precision precision = Precision::kFloat32;
  bool recompute = false;          ///< also the forms with the stages of the first 1 .. p ranks recomputing
  double memory_limit_bytes = 0;   ///< per rank, the planner's memory estimate (formulas); 0: any
  double communication_ms = 0;     ///< one activation message (measure_message_ms, agreed over the replicas)
};

/// The costs per chunk fitted to `measured` (the probes of `current`'s stages with I and W on every stage, B where
/// a standard probe ran: AutoSchedule::measured_costs; fit_llama_costs) and every schedule, mode (and recomputation
/// setting) of the other placements of `current`'s ranks and micro-batches ranked by plan_llama_layouts under them,
/// one replica's view (no data-parallel term: it differs little between placements of the same parameters, and the
/// measurement decides). Each stage cut by models::make_partition. Pure: the same on every rank given the same
/// inputs. No other placement (why_none says why) when the probes lack F, I or W on some stage, the planner finds
/// none, or none fits the memory limit.
PlacementRanking rank_llama_placements(const models::LlamaConfig& config, const Placement& current,
                                       const MeasuredCosts& measured, const PlacementPlanOptions& options);

/// Makes `pipeline` run `to`'s form of its own placement from the next step: the schedule switched, the stages of
/// `to.recompute_ranks` recomputing and the others not (same_placement must hold; UsageError otherwise).
void switch_form(Pipeline& pipeline, const Placement& to);

struct PlacementSearchOptions {
  int steps = 4;           ///< steps each candidate runs (>= 2; the first is warm-up)
  int candidates = 3;      ///< the fastest predicted measured, at most (>= 1)
  double within = 0.10;    ///< measured when predicted within this share of the best prediction
  Transport* replicas = nullptr;  ///< the data-parallel group, so that the replicas agree
  Duration timeout = std::chrono::minutes(5);
};

/// Measures the fastest predicted forms of other placements and keeps the fastest measured, the running form
/// included (measured already: `current_ms`). Every decision comes from agreed numbers, so every rank decides
/// alike. One per rank; not thread-safe.
class PlacementSearch {
 public:
  /// The program's part: make `to` (another placement) run from the next step -- e.g. save the weights and
  /// optimizer state by name, free the running chunks, build `to`'s chunks, Pipeline and optimizer and load the
  /// state -- and return its Pipeline (which must live until the next move, or the search's end). Collective as
  /// checkpoints are.
  using Rebuild = std::function<Pipeline&(const Placement& to)>;

  /// `pipeline` runs `current` (measured at `current_ms`, the slowest rank's median) and must live until the first
  /// move; its transport (the pipeline's ranks, which every rebuilt Pipeline runs over too) must outlive the
  /// search. UsageError on options out of range.
  PlacementSearch(Pipeline& pipeline, Placement current, double current_ms, Rebuild rebuild,
                  PlacementSearchOptions options);

  /// Shortlists up to `candidates` of `ranking.others` predicted within `within` of the best prediction (the
  /// current form's included) and moves to the first; done when none is. Returns the decision (one line).
  std::string start(const PlacementRanking& ranking);
  /// Call after every step while not done(), on every rank, with its result. Collective (a max over the ranks and
  /// the replicas, and a move) on the step that ends a candidate's measurement; returns the decision then.
  std::optional<std::string> after_step(const StepResult& result);

  bool done() const { return done_; }
  /// The placement and form running now, and its pipeline (a move replaces it).
  const Placement& running() const { return running_; }
  Pipeline& pipeline() const { return *pipeline_; }

 private:
  std::string settle(const std::string& measured);  // keeps the fastest measured; done
  const char* go_to(const Placement& to);          // switches or moves (not measured); returns the verb

  Pipeline* pipeline_;
  Placement running_;
  PlacementCandidate chosen_;  // the starting form (AutoSchedule's choice)
  double chosen_ms_;
  Rebuild rebuild_;
  PlacementSearchOptions options_;
  Trial trial_;
  std::vector<PlacementCandidate> trials_;
  std::vector<double> trial_ms_;
  bool done_ = false;
};

/// What LlamaAutoTuner does besides AutoSchedule's options (whose replicas, timeout, verify_steps,
/// measure_candidates and measure_within the placement search takes too).
struct LlamaAutoOptions {
  AutoScheduleOptions schedule;
  bool placements = false;  ///< after AutoSchedule, PlacementSearch over the forms of other placements
  /// The run's sizes and limits for rank_llama_placements; its communication_ms is measured when the search
  /// starts (measure_message_ms of one activation message on `device`, the most over the replicas).
  PlacementPlanOptions plan;
  c10::Device device = c10::Device(c10::kCPU);
};

/// measure → plan → run for a LLaMa pipeline at run time: AutoSchedule chooses among the starting placement's forms;
/// with LlamaAutoOptions::placements, PlacementSearch then measures the forms of other placements that
/// rank_llama_placements predicts fastest from AutoSchedule's probes, and keeps the fastest measured. The program
/// supplies the move (PlacementSearch::Rebuild). One per rank; not thread-safe.
class LlamaAutoTuner {
 public:
  /// `pipeline` runs `current` of `config` (it must live until the first move; see PlacementSearch).
  LlamaAutoTuner(Pipeline& pipeline, models::LlamaConfig config, Placement current, LlamaAutoOptions options,
                 PlacementSearch::Rebuild rebuild);

  /// Call after every step with its result, on every rank: what it decided on this step (collective on the steps
  /// where it decides: AutoSchedule::after_step, PlacementSearch::start and after_step).
  std::vector<std::string> after_step(const StepResult& result);
  /// The placement and form running now.
  const Placement& running() const { return running_; }
  /// AutoSchedule's last ranking, fastest predicted first.
  const std::vector<ScheduleCandidate>& ranking() const { return ranking_; }
  /// Whether nothing is left to measure.
  bool done() const { return !chooser_ && (!search_ || search_->done()); }

 private:
  std::string start_search();  // collective: the message time, the ranking, the first move

  models::LlamaConfig config_;
  Placement running_;
  std::vector<int> built_recompute_;  // the ranks recomputing as built
  LlamaAutoOptions options_;
  PlacementSearch::Rebuild rebuild_;
  Pipeline* pipeline_;  // the starting one (the search's after a move)
  std::optional<AutoSchedule> chooser_;
  std::optional<PlacementSearch> search_;
  std::vector<ScheduleCandidate> ranking_;
};

}  // namespace twobp
