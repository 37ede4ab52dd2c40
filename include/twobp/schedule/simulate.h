#pragma once
// Simulation of a schedule: step time under per-action costs (with data-parallel reductions) and peak memory
// under per-action memory. The planner and the benchmarks' predictions are made of these.

#include <array>
#include <vector>

#include "twobp/schedule/schedule.h"

namespace twobp {

/// Per-action costs for the simulator, in any time unit (the result uses the same unit).
struct CostModel {
  std::vector<double> forward;          ///< per stage
  std::vector<double> backward_input;   ///< per stage (I)
  std::vector<double> backward_weight;  ///< per stage and micro-batch (see weight())
  /// Per stage: the part of every W that does not grow with its micro-batches (kernel launches, a GEMM too small to
  /// fill the device), so that a W batched over several micro-batches -- 2BP's deferred W -- costs less per
  /// micro-batch than W's one by one, as GPUs measure it. Empty (the default): 0, W proportional to its size.
  std::vector<double> backward_weight_fixed;
  std::vector<double> backward;         ///< per stage (fused B); if empty, unfused_backward()
  /// Activation recomputation (StageOptions::recompute), per stage: the time to re-run the forward, added to every
  /// I and B of that stage (usually its forward cost; 0 for stages without). Empty (the default): no recomputation.
  std::vector<double> recompute;
  double communication = 0.0;           ///< latency of one send, sender to receiver
  /// A fixed cost of every compute action, whatever its size (kernel launches, the host's dispatch, a GEMM too
  /// small to fill the device): added once to each F, I, W and B -- per action on a chunk, so a rank's v chunks pay
  /// it v times as often, and a W over k micro-batches once -- on top of the per-stage costs above (and of
  /// recomputation, which runs inside its I or B). Charged where action_cost() prices an action, so
  /// simulate() and synthesize() both see it. 0 (the default): chunks have no fixed cost, their costs scale with
  /// their work. Measured: `twobp_bench split` at two --layers, or fit_llama_costs' per-action term.
  double per_action = 0.0;
  /// Overlapped F&B pairs (Action::overlapped_with_next) run at once, as a runtime with
  /// ExecutorOptions::overlap_forward_backward runs them: the share of the shorter part hidden under the longer, in
  /// [0, 1]. A pair of parts costing f and x then takes f + x - overlap * min(f, x), from when both parts' inputs
  /// are there, and both parts' outputs are ready at its end (the for_overlapped_pairs() layout, which simulate()
  /// then runs). 0 (the default): the parts run one after the other, as the executor runs them without a hook.
  /// Measured by CostRecorder (MeasuredCosts::overlap).
  double overlap = 0.0;

  /// Data parallelism (dp replicas of the pipeline): per stage, the time to all-reduce that stage's gradients over
  /// its data-parallel group (e.g. metrics::ring_all_reduce_seconds of its gradient bytes, in this model's unit).
  /// Empty (the default): no data parallelism, and simulate() behaves exactly as without these fields.
  std::vector<double> data_parallel_reduce;
  /// When a stage's all-reduce may start. true: as soon as its gradients are complete, i.e. at the end of the
  /// stage's last weight-producing action of the step (its last W, or last B in standard mode), so that it overlaps
  /// the rank's remaining actions and idle time (what 2BP's deferred W makes possible). false: after the rank's last
  /// action, as a framework that reduces all gradients once backward is over does.
  bool overlap_data_parallel = true;
  /// Each stage's reduction in this many equal buckets (>= 1). With overlap, the buckets of a stage whose last
  /// weight action is a W become ready one by one during that W (bucket j at (j + 1) / k of its duration: the
  /// runtime starts a bucket as soon as the W's layers that fill it have run); after a B all are ready at its end
  /// (the runtime reduces B's gradients once the B is over).
  int data_parallel_buckets = 1;

  /// The cost of a W of `micro_batches` micro-batches on `stage`: backward_weight_fixed[stage] + micro_batches *
  /// backward_weight[stage]. The one place the simulator's W formula is written.
  double weight(int stage, int micro_batches) const;
  /// A fused B's cost when `backward` is empty (or not measured): I + a W of one micro-batch.
  double unfused_backward(int stage) const;

  /// The same costs for every stage.
  static CostModel uniform(int num_stages, double f, double i, double w, double comm = 0.0);
};

/// What one compute action costs under `costs`, as simulate() and the synthesizer charge it: F; I or B with the
/// stage's recomputation; a W over k micro-batches (CostModel::weight); plus CostModel::per_action once. 0 for
/// communication actions. Precondition: the vectors the action reads cover its stage (simulate() checks them).
double action_cost(const Action& action, const CostModel& costs);

/// Costs of one rank's share of the model, as `twobp_bench simulate` takes them (--f --i --w --b --comm): a
/// placement with v chunks per rank gives each chunk 1/v of F, I, W, B and the W's fixed part; communication is
/// per message and is not divided.
struct RankCosts {
  double forward = 1.0;
  double backward_input = 1.0;
  double backward_weight = 1.0;
  double backward = 2.0;  ///< fused B
  double backward_weight_fixed = 0.0;
  double communication = 0.0;

  /// Per-stage costs for a pipeline of `num_stages` stages over `ranks` ranks (v = num_stages / ranks). Throws
  /// UsageError when the stages do not split evenly into the ranks.
  CostModel per_stage(int num_stages, int ranks) const;
};

struct SimulatedEvent {
  int rank = 0;
  Action action;
  double start = 0.0;
  double end = 0.0;
};

struct SimulationResult {
  /// The slowest rank's step end: max over ranks of max(end of its last action, end of its last all-reduce).
  double step_time = 0.0;
  /// metrics::bubble_fraction (twobp/metrics/metrics.h) of the compute busy times over step_time (so all-reduce
  /// time that is not hidden counts as idle compute).
  double bubble_fraction = 0.0;
  /// Data parallelism (CostModel::data_parallel_reduce): how far the all-reduces pushed a rank's step end past its
  /// last action, max(0, end of its last all-reduce − end of its last action), per rank (size num_ranks; all 0
  /// without data parallelism), and the max over ranks. step_time − (step_time without data parallelism) can be
  /// smaller than data_parallel_exposed, when the rank whose reductions are exposed is not the slowest.
  std::vector<double> data_parallel_exposed_per_rank;
  double data_parallel_exposed = 0.0;
  std::vector<int> peak_live_micro_batches;  ///< per rank: max micro-batches whose activations are alive
  std::vector<SimulatedEvent> events;        ///< compute actions with their times
};

/// Event-driven simulation of `schedule` under `costs`: each rank runs its actions in order, an F/I/B waits for
/// its input to arrive (communication latency after the producer finished). With CostModel::overlap > 0 the
/// schedule's overlapped pairs run at once, in the for_overlapped_pairs() layout (both events span the pair; the
/// bubble counts the pair's span once).
/// With data parallelism (costs.data_parallel_reduce not empty) each rank also has one reduction link, separate from
/// compute and from pipeline communication: each bucket of each of its stages (CostModel::data_parallel_buckets)
/// starts at max(when it is ready -- see CostModel::overlap_data_parallel --, when the link is free), in the order
/// they become ready (ties: lower stage first), and lasts data_parallel_reduce[stage] / buckets. The optimizer step
/// needs every reduction, so the rank's step ends when both its actions and its reductions are done.
/// Throws UsageError when a cost vector the schedule needs has the wrong size, any time of `costs` (F, I, W, W0, B,
/// recompute, communication, per_action, data_parallel_reduce) is NaN, infinite or negative (the message names the
/// member and stage, "simulate: CostModel.forward[1] is nan, ..."), overlap is outside [0, 1], or finite costs add up
/// to an infinite step time. It does not compare B with I and W (CostSource, which takes the programs' per-rank costs,
/// does).
SimulationResult simulate(const Schedule& schedule, const CostModel& costs);

/// Tensor memory of one kind of action on one stage, in bytes, for simulate_peak_memory(): what one action leaves
/// allocated when it ends (`added`; negative when it frees more than it allocates) and the most it adds while it
/// runs (`rise`: its working memory plus what it keeps). For W both are per micro-batch of the action. In these
/// terms a micro-batch's activations on a stage are F's `added`, and the (input, output gradient) pairs a deferred
/// W keeps (2BP's extra memory) are −W's `added`.
struct ActionMemory {
  double added = 0.0;
  double rise = 0.0;
};

/// What simulate_peak_memory() needs, in bytes (measured by `twobp_bench pipeline`, or estimated).
struct MemoryModel {
  /// Per rank: tensor memory held when a step starts (weights, optimizer state, caches).
  std::vector<double> base;
  /// Per stage: one ActionMemory per action type, indexed by static_cast<int>(ActionType).
  std::vector<std::array<ActionMemory, kNumActionTypes>> stages;
  /// Per stage: gradient bytes its first weight action of a step (W or B) allocates -- when gradients are reset to
  /// undefined between steps, as Pipeline::zero_grad() does. Empty: none.
  std::vector<double> gradients;
};

/// Peak tensor memory of each rank over one step of `schedule`: each rank walks its actions in order (a rank's
/// memory changes only by its own actions), from base[r]; an action reaches level + rise and leaves level + added
/// (× micro-batches for W; plus gradients[stage] for the stage's first W or B). Throws UsageError when `model`
/// does not cover the schedule's ranks and stages.
std::vector<double> simulate_peak_memory(const Schedule& schedule, const MemoryModel& model);

}  // namespace twobp
