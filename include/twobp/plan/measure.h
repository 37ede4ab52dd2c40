#pragma once
// What a run measured, in the simulator's terms: per-stage costs of each action type and the memory model, taken
// from the traces of a run's steps, agreed over the pipeline's ranks, and written to / read from JSON in one form.
// This is the "measure" third of measure → plan → run: `simulate(schedule, costs.cost_model(mode))` and
// `simulate_peak_memory(schedule, memory)` predict another schedule from a run of one (twobp/schedule/simulate.h).
//
//   CostRecorder costs(schedule.num_stages);
//   MemoryRecorder memory(schedule.num_stages, stage_gradient_bytes(pipeline));  // ExecutorOptions::record_memory
//   for (each measured step) { StepResult r = pipeline.step(x, y); costs.add(r.trace); memory.add(r.trace); }
//   MeasuredCosts all = agree_costs(transport, costs.local_medians(), timeout);   // collective: every rank
//   MemoryModel mem = agree_memory(transport, memory.local_medians(rank, p), timeout);
//   SimulationResult other = simulate(other_schedule, all.cost_model(BackwardMode::kSplit));
//
// Units: costs in milliseconds, memory in bytes. Each stage lives on one rank, which alone records it; the agreed
// value of a stage is that rank's median (the others contribute 0).

#include <array>
#include <map>
#include <string>
#include <vector>

#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

namespace twobp {

class Pipeline;

/// Per-stage costs of a run in milliseconds: for each action type, the median over its occurrences in the
/// measured steps. An action type the run's mode does not have is 0 (I and W in standard mode, B in 2BP mode).
struct MeasuredCosts {
  std::vector<double> forward;          ///< F, per stage
  std::vector<double> backward_input;   ///< I, per stage, without its recomputation
  std::vector<double> backward_weight;  ///< W per micro-batch, per stage (CostModel::weight)
  /// The fixed part of every W, per stage (CostModel::backward_weight_fixed): a W of k micro-batches costs
  /// backward_weight_fixed + k * backward_weight. Empty: no stage's W's showed one (see CostRecorder).
  std::vector<double> backward_weight_fixed;
  std::vector<double> backward;         ///< fused B, per stage, without its recomputation
  /// The recomputation inside an I or B (StageOptions::recompute), per stage. Empty: the run did not recompute.
  std::vector<double> recompute;
  /// One send of an activation, sender to receiver (measured apart from the steps, e.g. by a ping-pong).
  double communication = 0.0;
  /// Overlapped F&B pairs the run ran at once (ExecutorOptions::overlap_forward_backward): the share of a pair's
  /// shorter part hidden under the longer (CostModel::overlap, in [0, 1]), and how many pairs it was measured from.
  /// 0 and 0 when the run ran none at once (pairs run in order are ordinary actions).
  double overlap = 0.0;
  int overlapped_pairs = 0;

  int num_stages() const { return static_cast<int>(forward.size()); }

  /// The simulator's costs for running the measured stages in `mode`: F, recomputation, communication and the
  /// pairs' overlap as measured; kSplit takes I and W (and B where the run had fused B's, as DualPipeV's 2BP form
  /// has; else the simulator's B is I + W), kStandard takes B (I and W 0). Throws UsageError when the costs `mode`
  /// needs are all 0 (a standard run holds no I/W, a 2BP run no B), or check_measured_costs() refuses them.
  CostModel cost_model(BackwardMode mode) const;
};

/// The one check of measured costs where they enter the planners (parse_measured_costs, MeasuredCosts::cost_model,
/// CostSource, rank_schedules): every list one entry per stage (recompute and backward_weight_fixed may be empty),
/// every entry and communication a finite time in [0, 1e9] ms (1e9 ms, 11.6 days, is the programs' bound on a
/// cost; 1e308 would overflow the sums), overlap in [0, 1]. Throws UsageError "<where>: costs_ms.W[1] is nan,
/// expected ..." naming the field and stage. Measured costs are not held to B >= max(I, W) (a noisy measurement of
/// a cheap W is still a measurement); the per-rank costs a user states are (CostSource).
void check_measured_costs(const MeasuredCosts& costs, const std::string& where);

/// A W's cost in the simulator's terms (CostModel::weight): fixed + micro-batches × per_micro_batch.
struct WeightCost {
  double fixed = 0.0;
  double per_micro_batch = 0.0;
};

/// CostRecorder's W rule (below), for durations measured elsewhere (e.g. `twobp_bench split --batched-w`): from W
/// durations in ms by their micro-batch count, the cost. One count: no fixed part, the median duration per
/// micro-batch. Two or more: the least-squares line through each count's median when its fixed part and slope are
/// both positive, else as for one count. Throws UsageError on a count < 1 or a negative or non-finite duration.
WeightCost fit_weight_cost(const std::map<int, std::vector<double>>& ms_by_micro_batches);

/// Collects this rank's per-action durations from the traces of measured steps (Pipeline::step's StepResult::trace;
/// leave the first, warm-up steps out). Each I and B is recorded without its recomputation, which is recorded apart.
///
/// Overlapped F&B pairs run one part after the other (no hook) are ordinary actions. A pair run at once
/// (ran_as_pair: both events span the pair) tells neither part's own cost, only the pair's span t; the parts' costs
/// come from the same stages' actions outside pairs, and the overlap from the pairs whose both parts have such
/// costs f and x: the median over them of (f + x - t) / min(f, x), clamped to [0, 1] (CostModel::overlap's model,
/// inverted). A part seen only inside pairs (DualPipeV's 2BP form fuses the B's of its first stage in pairs only)
/// gets the cost that makes the model give its pairs' measured span, the median over its pairs.
///
/// W: each stage's W durations by micro-batch count through fit_weight_cost. A stage whose W's came in one size k
/// (every W per micro-batch, or one batched W per step) gets the median of duration / k and no fixed part -- one
/// size cannot tell them apart; W's of two or more sizes (a zero-bubble order's W's one by one and the W's a rank
/// batches at its end, or two probed schedules) give the line through each size's median.
class CostRecorder {
 public:
  explicit CostRecorder(int num_stages);

  /// One step's trace. Throws UsageError naming the event when a stage is out of range.
  void add(const Trace& trace);

  /// This rank's medians: a stage or action type it recorded nothing of is 0; recompute is empty when no I or B
  /// recorded any recomputation; communication is 0 (set it from a measurement of your own).
  MeasuredCosts local_medians() const;

  /// Steps recorded so far.
  int steps() const { return steps_; }

 private:
  int num_stages_;
  int steps_ = 0;
  // [stage]: samples in ms of F, I, B, and recomputation (per I or B).
  std::vector<std::vector<double>> f_, i_, b_, r_;
  // [stage][micro-batches of the W]: samples in ms of whole W's.
  std::vector<std::map<int, std::vector<double>>> w_;
  // Overlapped pairs run at once: the F's stage, the second part's type and stage, the pair's span in ms.
  struct PairSample {
    int forward_stage = 0;
    ActionType second_type = ActionType::kBackward;
    int second_stage = 0;
    double ms = 0.0;
  };
  std::vector<PairSample> pairs_;
  void resolve_pairs(MeasuredCosts& costs) const;  // the overlap, and the parts seen only in pairs
};

/// Every rank's local_medians() summed (all-reduces over `transport`, the pipeline's ranks): with each stage
/// recorded by one rank, every rank gets every stage's costs. Collective: every rank calls it. communication is
/// the max over ranks; recompute and backward_weight_fixed are kept when any rank has them; overlap is the mean
/// over the ranks' pairs (weighted by overlapped_pairs, which is summed). With data parallelism
/// pass the rank's data-parallel group as `replicas`: the replicas' costs are then averaged too (one more
/// all-reduce over it), so that every rank of the job holds the same numbers and makes the same choices from them.
MeasuredCosts agree_costs(Transport& transport, const MeasuredCosts& mine, Duration timeout,
                          Transport* replicas = nullptr);

/// MeasuredCosts::communication as the measurements take it: half the median round trip of a message like
/// `message` (its shape, dtype and device) between ranks 0 and 1 of `transport`, over `round_trips` round trips.
/// Collective over the transport (the other ranks wait); every rank gets rank 0's number; 0 with one rank.
double measure_message_ms(Transport& transport, const at::Tensor& message, Duration timeout, int round_trips = 25);

/// Collects the memory model of simulate_peak_memory() from this rank's measured steps (the pipeline must run with
/// ExecutorOptions::record_memory, else add() throws UsageError). `gradient_bytes[s]` is the .grad bytes stage s's
/// parameters allocate on this rank (0 for stages of other ranks; a tensor shared by two stages counted once): a
/// stage's first W or B of a step allocates them, and that allocation is taken out of the action and given to
/// MemoryModel::gradients instead.
///
/// Messages freed between actions: a tensor sent to another rank (an input gradient sent upstream, charged to
/// this rank on threads) is freed when the receiver is done with it, often while this rank is between actions, so
/// the free falls into no action's delta, and a walk of the raw medians would drift upwards by one message per
/// micro-batch (+36 % at p = 8 on V schedules). local_medians() therefore closes each stage's model -- its
/// actions of one step, walked with the medians, leave nothing behind but gradients -- by taking the residual
/// out of the backward actions' `added` (I and B, which allocate what is sent upstream), evenly per action,
/// scaled by the share of the residual that the memory changes seen between actions account for (so that what a
/// step legitimately keeps past its last action, such as data-parallel buckets, stays). `rise` is kept.
class MemoryRecorder {
 public:
  MemoryRecorder(int num_stages, std::vector<double> gradient_bytes);

  void add(const Trace& trace);

  /// This rank's part of the model, for rank `rank` of `num_ranks`: base[rank] the median memory when a step
  /// starts (other ranks' 0), each recorded stage's median `added` (closed, see above) and `rise` per action
  /// type, its gradient bytes.
  MemoryModel local_medians(int rank, int num_ranks) const;

 private:
  int num_stages_;
  std::vector<double> gradient_bytes_;
  std::vector<double> base_;
  // [stage][action type]: samples of added and rise (W: per micro-batch).
  std::vector<std::array<std::vector<double>, kNumActionTypes>> added_, rise_;
  // [stage][action type]: how many actions (W: micro-batches) all recorded steps ran, for the closure.
  std::vector<std::array<double, kNumActionTypes>> count_;
  // Over all recorded steps: what the actions left behind (gradients taken out), and the changes between them.
  double left_ = 0.0, between_ = 0.0;
};

/// Every rank's MemoryRecorder::local_medians() summed (one all-reduce over the pipeline's ranks). Collective.
/// With data parallelism pass the rank's data-parallel group as `replicas`: the replicas' models are then
/// averaged too (as agree_costs), so that every rank of the job holds the same model.
MemoryModel agree_memory(Transport& transport, const MemoryModel& mine, Duration timeout,
                         Transport* replicas = nullptr);

/// A run's peak tensor memory per pipeline rank (bytes): as measured, and as its own memory model predicts it.
struct PeakMemory {
  MemoryModel model;               ///< agree_memory() of the ranks' MemoryRecorder::local_medians()
  std::vector<double> measured;    ///< per rank: the largest peak of its measured steps (`my_peak` of each)
  std::vector<double> predicted;   ///< per rank: simulate_peak_memory(schedule, model)
  /// Both less what a rank holds whatever its step does (its MemoryModel::base and its stages' gradients): the
  /// part the schedule moves, where a prediction's error shows.
  std::vector<double> measured_step, predicted_step;
};

/// The peak memory of a run measured by `recorder` on every rank of the pipeline (`transport`); `my_peak` is this
/// rank's measured peak (the largest StepResult::peak_memory_bytes of the steps the recorder saw). Collective over
/// the pipeline; every rank gets every rank's numbers.
PeakMemory compare_peak_memory(Transport& transport, const Schedule& schedule, const MemoryRecorder& recorder,
                               double my_peak, Duration timeout);

/// MemoryRecorder's `gradient_bytes` for this rank of `pipeline`: per stage, the .grad bytes its trainable
/// parameters allocate (a tensor shared by two of the rank's stages counted once, in the first; with mixed
/// precision the float32 masters' gradients, which are the ones allocated), 0 for other ranks' stages.
std::vector<double> stage_gradient_bytes(Pipeline& pipeline);

/// The JSON form of measured costs, the one writer of it: an object
///   {"communication_ms": c, "costs_ms": {"F": [...], "I": [...], "W": [...], "B": [...], "R": [...], "W0": [...]},
///    "overlap": {"share": o, "pairs": n}}
/// (per stage; "R" and "W0" -- backward_weight_fixed -- only when not empty, "overlap" only when pairs ran at
/// once) -- the fields every result of `twobp_bench pipeline --json` carries, so that a result is itself readable
/// by parse_measured_costs().
std::string measured_costs_json(const MeasuredCosts& costs);

/// The one reader of that form: reads "communication_ms" and "costs_ms" from a JSON object (other fields are
/// ignored, so a whole result of `twobp_bench pipeline --json` can be given). "F" is required; a missing "I", "W"
/// or "B" reads as 0 for every stage, a missing "R" as no recomputation, a missing "W0" as no fixed W part, a
/// missing "overlap" as no pair run at once.
/// Throws UsageError, naming `where` and the field, when the text is not a JSON object, a field is missing or not a
/// number, a number is refused by check_measured_costs (NaN cannot be written in JSON; negative, or above 1e9 ms,
/// as 1e308), or the lists' sizes differ.
MeasuredCosts parse_measured_costs(const std::string& json_object, const std::string& where);

}  // namespace twobp
