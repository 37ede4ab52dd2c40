#pragma once
// The per-rank runtime: a Pipeline owns this rank's chunks (as Stages), a Transport and a Schedule, and runs
// one training step at a time by interpreting the rank's action list.

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/executor.h"
#include "twobp/schedule/schedule.h"
#include "twobp/stage.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

namespace twobp {

/// One chunk of the model owned by this rank: the global stage index it implements and its module.
struct PipelineChunk {
  int stage = 0;
  std::shared_ptr<torch::nn::Module> module;
  StageForward forward;
  /// Activation recomputation for this stage (StageOptions::recompute): F keeps only its inputs, I or B re-runs
  /// the forward first.
  bool recompute = false;
  /// Generators of this chunk's own that its forward draws from, replayed when recomputing
  /// (StageOptions::replay_generators). Not needed for twobp::stage_generator() / nn::Dropout.
  std::vector<at::Generator> replay_generators = {};
};

/// Mixed precision: the chunks compute in a lower precision, the optimizer steps float32 master weights.
///
/// With compute_dtype = kBFloat16 the Pipeline, at construction, copies every trainable parameter of its chunks
/// (built in float32) into a float32 master and converts the chunks to bfloat16 (Module::to: buffers too).
/// parameters() then returns the masters: give them to the optimizer; gradients, norms, clipping, the optimizer
/// gate and zero_grad() all act on them. Each micro-batch's weight gradient (bfloat16, from autograd or W) is
/// added to its master's float32 .grad as soon as it is accumulated (a post-accumulate-grad hook on the compute
/// parameter), so gradients accumulate over micro-batches in float32; the compute parameters' .grad stays
/// undefined. Every step() first copies the masters into the compute parameters (rounding once), and casts the
/// floating-point inputs of the first stage to bfloat16. Activations (and so activation_spec dtypes) and the
/// loss's input are bfloat16.
/// With data parallelism the replicas average the masters' float32 gradients (buckets of float32). WHY float32
/// and not bfloat16 buckets: a bfloat16 sum over replicas rounds each partial sum to 8 significant bits, and the
/// masters' gradients already exist in float32; the cost is twice the bytes of a bfloat16 reduction, hidden in W
/// like any bucket (Megatron-LM reduces its float32 main gradients by default for the same reason).
/// Refused at construction, with a UsageError: a parameter that is not float32 or already has a post-accumulate
/// hook, and kHalf (fp16 needs dynamic loss scaling, which twobp does not have: use bfloat16).
struct MixedPrecisionOptions {
  /// kFloat: off (the chunks train in whatever dtype they have). kBFloat16: on.
  at::ScalarType compute_dtype = at::kFloat;
  bool enabled() const { return compute_dtype != at::kFloat; }
};

/// How the micro-batches' losses make a step's loss (PipelineOptions::loss_reduction).
enum class LossReduction {
  /// The mean of the micro-batches' losses (each weighs 1/num_micro_batches), averaged over the data-parallel
  /// replicas. With a loss that is a mean over a micro-batch's items, the global batch's mean only when every
  /// micro-batch holds as many items (not so with padding or packed documents).
  kMeanOfMicroBatches,
  /// The mean over every item of the global batch, however it is cut into micro-batches, replicas or ranks (what
  /// transformers' loss and its Trainer under gradient accumulation optimise): `loss` returns a micro-batch's SUM
  /// over its items, and before each step (and evaluate()) the last stage counts the batch's items with
  /// `loss_items`, summed over the replicas (one scalar all-reduce), and scales every micro-batch's loss by
  /// 1 / that count. UsageError when the global batch holds no item.
  kMeanOverItems,
};

/// One weight kept as a copy on each of several stages: tied input and output embeddings when the embedding is on
/// the first stage and the head on the last (as Megatron-LM's embedding group). The Pipeline keeps the copies one
/// weight (PipelineOptions::tied_parameters):
///   construction  every copy is set to the first copy's values (broadcast from the rank that holds it), after
///                 checking that the copies agree in shape, dtype and requires_grad (UsageError naming them);
///   every step    after the backward (and the data-parallel averaging), each copy's .grad becomes the sum of all
///                 copies' gradients -- the tied weight's gradient -- (undefined where every copy's is undefined;
///                 a sparse one is made dense), so every copy takes the same optimizer step;
///   norms         the gradient norm counts the tie once (the first copy's), so clipping and the gate see the tied
///                 model's norm; clipping scales every copy alike.
/// The copies must be distinct tensors (two stages of one rank sharing one tensor are already tied: refused).
/// Copies on one rank are summed there; copies on several ranks through a group split from the pipeline's
/// transport at construction, which is then collective over every pipeline rank (the same list on every rank).
struct TiedParameter {
  std::string name;  ///< what errors and the hang report call it, e.g. "embedding"
  /// (stage, name of the parameter in that stage's module), at least two, on distinct stages; the first is the
  /// source of the values at construction and the one the gradient norm counts.
  std::vector<std::pair<int, std::string>> copies;
};

/// A PipelineOptions field of twobp 0.1 that moved into PipelineOptions::executor (same name) in 0.2.0: assigning
/// it compiles with a deprecation warning and is forwarded; nothing else of the old field's type is offered
/// (reading it back was rare in 0.1 code: read `executor.<name>`).
template <typename T>
class MovedToExecutor {
 public:
  [[deprecated("this option moved into PipelineOptions::executor (same name) in twobp 0.2.0: write "
               "options.executor.<name>; see CHANGELOG.md")]] MovedToExecutor&
  operator=(T value) {
    value_ = std::move(value);
    return *this;
  }
  /// The value assigned through the deprecated path, if any.
  const std::optional<T>& assigned() const { return value_; }
  /// Assigns without the warning (the library's own forwarding).
  void assign(T value) { value_ = std::move(value); }
  void reset() { value_.reset(); }

 private:
  std::optional<T> value_;
};

struct PipelineOptions {
  /// How each step runs (ExecutorOptions): the timeout of every blocking wait -- which also bounds the pipeline's
  /// own collectives --, fixed boundary specs (at most one of activation_spec and boundary_spec; asked only for
  /// boundaries that cross ranks), receive prefetch, memory records and bounds, overlapped F&B pairs (the pipeline
  /// then runs the schedule in its for_overlapped_pairs() layout). The pipeline sets run_counter, parameters_done
  /// and evaluate itself: leave them unset.
  ExecutorOptions executor;
  /// Verifies every activation and gradient message end to end with a checksum of its bytes (the pipeline talks
  /// through a ChecksummingTransport, twobp/transport/checksum.h): a message corrupted in transit fails the step
  /// on every rank naming the receiver, the sender and the message, instead of changing the gradients silently.
  /// Costs per message a pass over its bytes on both sides, an 8-byte message, and on GPUs a host synchronisation
  /// at the receiver. Every rank must set it alike. Off by default.
  bool verify_messages = false;
  /// The seed of the stages' random streams (StageOptions::seed, twobp/random.h): with the same seed, a forward
  /// that draws from twobp::stage_generator() (nn::Dropout) draws the same numbers on every run, whether ranks
  /// are threads or processes, under every schedule, 2BP or fused.
  uint64_t seed = 0;
  /// Loss of the last stage, (output, target) -> scalar. How the micro-batches' losses make the step's loss:
  /// `loss_reduction`. By default averaged over micro-batches: each micro-batch's loss gradient is scaled by
  /// 1/num_micro_batches, so a step's gradients equal those of the mean loss over the batch, matching a
  /// non-pipelined run of the same batch when the micro-batches hold equally many items.
  LossFunction loss;
  LossReduction loss_reduction = LossReduction::kMeanOfMicroBatches;
  /// LossReduction::kMeanOverItems: how many items (e.g. target tokens not masked out) `targets` holds -- a
  /// micro-batch's or the whole batch's targets; it must add up over micro-batches. Required then (UsageError on
  /// the last stage's rank at construction otherwise); unused by kMeanOfMicroBatches.
  std::function<double(const NamedTensors& targets)> loss_items;
  /// W actions naming several micro-batches give each layer all of them at once (see StageOptions).
  bool batch_weight_grads = true;
  /// Data parallelism: the group of this stage's replicas and how gradients are averaged over it (see
  /// twobp/runtime/data_parallel.h). With a group of more than one rank, the constructor is collective over it,
  /// step() returns averaged gradients, and mean_loss() / check_gradients() cover every replica.
  DataParallelOptions data_parallel;
  /// bfloat16 compute with float32 master weights (see MixedPrecisionOptions). Off by default.
  MixedPrecisionOptions mixed_precision;
  /// Weights held as copies on several stages (TiedParameter): the same list on every rank. Empty by default.
  std::vector<TiedParameter> tied_parameters;

  /// Deprecated in 0.2.0, kept in 0.3.0, to be removed in 0.4.0: where these options were in 0.1, before they
  /// moved into `executor` under the same names (CHANGELOG.md). 0.1 code that assigns them still compiles, with a
  /// deprecation warning, and works: the Pipeline's constructor copies a field that was assigned into `executor`
  /// (with_moved_executor_options); one set both here and in `executor` is refused (UsageError naming it).
  MovedToExecutor<Duration> timeout;
  MovedToExecutor<std::function<TensorSpec(int stage)>> activation_spec;
  MovedToExecutor<std::function<BoundarySpec(int stage)>> boundary_spec;
  MovedToExecutor<int> prefetch_receives;
  MovedToExecutor<int> max_pending_weight_micro_batches;
  MovedToExecutor<int64_t> memory_limit_bytes;
  MovedToExecutor<bool> record_memory;
  MovedToExecutor<c10::Device> memory_device;
  MovedToExecutor<decltype(ExecutorOptions::overlap_forward_backward)> overlap_forward_backward;
};

/// `options` with the deprecated 0.1 fields moved into `executor` (and cleared). UsageError when one is set in
/// both places with different values. The Pipeline's constructor calls it; exposed for tests and wrappers.
PipelineOptions with_moved_executor_options(PipelineOptions options);

/// What to do when a step produced a NaN or Inf loss or gradient.
enum class NonFinitePolicy {
  kStop,      ///< throw NumericalError naming the step and the stages
  kSkipStep,  ///< zero the gradients and skip the optimizer step (counted in skipped_steps())
};

/// One parameter's part of this replica's ZeRO-2 shards (Pipeline::parameter_shard_layout): elements
/// [param_offset, param_offset + numel) of `parameter` (flattened) are elements [shard_offset, shard_offset + numel)
/// of parameter_shards()[shard].
struct ParameterShardSlice {
  at::Tensor parameter;  ///< the compute parameter, or its float32 master under mixed precision
  std::size_t shard = 0;
  std::int64_t param_offset = 0;
  std::int64_t shard_offset = 0;
  std::int64_t numel = 0;
};

/// What one rank holds and sends for its data-parallel replica, in bytes (Pipeline::replica_memory; with the
/// optimizer's state: twobp::replica_memory in twobp/runtime/sharded_optimizer.h). The ZeRO stages differ in
/// gradient_peak + masters + optimizer_state and in bytes_sent.
struct ReplicaMemory {
  int64_t parameters = 0;       ///< the chunks' trainable parameters as they compute (bfloat16 under mixed precision)
  /// The most gradient bytes alive at once on this rank during the last step (parameters' or masters' .grad,
  /// ZeRO-2 shards, reduction buffers in flight), sampled after every action and at every bucket start; -1
  /// without data parallelism (the reducer samples it).
  int64_t gradient_peak = -1;
  int64_t masters = 0;          ///< float32 master weights (mixed precision; kept whole at every ZeRO stage)
  int64_t optimizer_state = 0;  ///< the optimizer's state (twobp::replica_memory fills it)
  /// Bytes sent in data-parallel collectives for the last step (collective_bytes_sent's ring formula): the
  /// gradient reduction, with ZeRO-2 the all-gather, with ZeRO-1 the optimizer's broadcasts (twobp::replica_memory).
  int64_t bytes_sent = 0;
};

/// Result of Pipeline::check_gradients(), identical on every rank.
struct GradientCheck {
  double norm = 0.0;                   ///< global L2 norm over all ranks' gradients (non-finite if any is)
  std::vector<int> non_finite_stages;  ///< stages whose gradients or losses hold a NaN or Inf
  bool finite() const { return non_finite_stages.empty(); }
};

/// One per rank. Not thread-safe; several Pipelines (one per thread) may share a process, each owning its tensors:
/// the first step of rank threads refuses a parameter or buffer that chunks of two ranks (or replicas) share.
///
/// step() contract: every rank calls step() once per training step with the same number of micro-batches.
/// `inputs` (the whole batch, each tensor split along dim 0 into micro-batches) is required on the rank owning
/// stage 0, `targets` on the rank owning the last stage; other ranks may pass undefined tensors (empty sets).
/// `targets` reach the last stage directly -- its loss and, for a forward taking NamedTensors, its forward too --
/// so labels and masks need not be relayed through the pipeline. Parameter gradients are
/// accumulated into .grad (call zero_grad() between steps). On any error the pipeline aborts the transport so
/// every peer fails fast naming this rank, forgets the step's state and rethrows.
class Pipeline {
 public:
  Pipeline(Schedule schedule, std::vector<PipelineChunk> chunks, std::shared_ptr<Transport> transport,
           PipelineOptions options);
  /// Borrows `transport`, which must outlive the pipeline (e.g. a transport on the stack of main()).
  Pipeline(Schedule schedule, std::vector<PipelineChunk> chunks, Transport& transport, PipelineOptions options);
  ~Pipeline();

  /// One training step (see the class comment); runs this rank's action list through its Executor, then (data
  /// parallelism) waits for the gradient reductions.
  StepResult step(const NamedTensors& inputs, const NamedTensors& targets);
  /// One step over micro-batches given one by one (shapes may differ between them: sequence lengths, sizes;
  /// each micro-batch's loss still counts 1/num_micro_batches). One entry per micro-batch where needed (see the
  /// class comment), empty vectors elsewhere.
  StepResult step(const std::vector<NamedTensors>& inputs, const std::vector<NamedTensors>& targets);
  /// Evaluation, collective over the pipeline (and the data-parallel group): a forward-only pass of a batch
  /// through the pipeline, returning on every rank the mean loss over its micro-batches and the replicas (the
  /// global batch's mean loss for a loss that is a mean over equal micro-batches). Inputs and targets as for
  /// step(), with the schedule's number of micro-batches; the schedule's forward actions in its order
  /// (forward_only()), so every schedule, placement and transport that trains also evaluates. Keeps no graph and
  /// touches no gradient, so it may run between step() and the optimizer; the chunks run in eval() mode for its
  /// duration (dropout off, BatchNorm on its running statistics), their train/eval flags restored afterwards.
  /// With mixed precision the masters are copied into the chunks first, as step() does. Not counted in the
  /// hooks, mean_loss() or the optimizer gate.
  double evaluate(const NamedTensors& inputs, const NamedTensors& targets);
  /// Evaluation over micro-batches given one by one (see the step() overload).
  double evaluate(const std::vector<NamedTensors>& inputs, const std::vector<NamedTensors>& targets);
  /// Runs `hook` after every action of every step (see Executor::add_hook), under every schedule switch_schedule()
  /// puts in place.
  void add_hook(Executor::Hook hook);
  /// Runs the following steps with `next` (a step boundary: between step() calls, never inside one): the same
  /// chunks, parameters, gradients, mixed-precision masters and hooks, a new action list. Every rank of the
  /// pipeline, and with data parallelism every replica, must switch before the same step (the replicas compare
  /// their new reduction buckets: collective over the data-parallel group). `next` must keep the placement
  /// (num_ranks, num_stages, stage_to_rank) and num_micro_batches; its mode and order are free, e.g. from
  /// 1F1B to ZB-H1 or from standard backprop to 2BP. Throws UsageError (placement, micro-batches) or
  /// ScheduleError (validate() with this transport's pairing) and keeps the running schedule; an error after that
  /// point aborts the transports, as a failed step does. Gradients are those of `next` from the next step on:
  /// every schedule computes the same sums (the tests check this against loss.backward()).
  void switch_schedule(Schedule next);
  /// The ZeRO stage the pipeline runs: DataParallelOptions::zero (k2 only with a data-parallel group of more than
  /// one replica; k2 over one replica behaves as k0).
  ZeroStage zero_stage() const;
  /// ZeroStage::k2: this replica's shard of every flat bucket (in bucket order; some may be empty): tensors over the
  /// working weights' storage (with mixed precision the float32 masters'), whose .grad holds this replica's shard of
  /// the averaged gradient after step() (the parameters' own .grad stay undefined). What ShardedOptimizer steps.
  /// Empty otherwise.
  std::vector<at::Tensor> parameter_shards() const;
  /// Where each parameter's elements sit in parameter_shards() (ZeroStage::k2; empty otherwise): one entry per
  /// parameter (its master under mixed precision) with elements in this replica's shards.
  std::vector<ParameterShardSlice> parameter_shard_layout() const;
  /// ZeroStage::k2, collective over the data-parallel group: all-gathers every replica's (updated) shards into the
  /// working weights (masters). ShardedOptimizer::step() calls it after stepping the shards; a wait on the board.
  void gather_parameter_shards();
  /// Bytes this rank sent in data-parallel collectives (collective_bytes_sent's ring formula) in the last step():
  /// the gradient all-reduces (k0, k1) or reduce-scatters (k2) and their flags, plus with k2 the all-gather of
  /// gather_parameter_shards() since. ZeRO-1's broadcasts are ShardedOptimizer::bytes_sent(). 0 without data
  /// parallelism.
  std::int64_t data_parallel_bytes_sent() const;
  /// This rank's parameters, gradient peak, masters and data-parallel bytes of the last step (optimizer_state 0:
  /// see twobp::replica_memory).
  ReplicaMemory replica_memory() const;
  /// The mean over micro-batches (and replicas) of the last step's losses, on every rank (collective: one
  /// all-reduce, and one over the data-parallel group).
  double mean_loss(const StepResult& result);
  /// Runs `collective`, a blocking collective over `group` (this pipeline's transport, its data-parallel group) that
  /// the job makes outside step() -- ShardedOptimizer's broadcasts, a collective of the caller's own -- as a wait of
  /// this rank on the status board: `what` ("the sharded optimizer's broadcasts") with the group's other ranks. A
  /// rank that never joins it is then named in the one job-wide hang report, which the TimeoutError it raises on
  /// this rank carries. Rethrows what `collective` throws.
  void run_collective(Transport& group, const std::string& what, const std::function<void()>& collective);

  const Schedule& schedule() const { return schedule_; }
  const PipelineOptions& options() const { return options_; }
  Transport& transport() { return *transport_; }
  int rank() const { return transport_->rank(); }
  /// The stages (chunks) this rank owns, by global stage index.
  Stage& stage(int index);
  std::vector<int> stage_indices() const;
  /// Parameters of this rank's chunks, each tensor once; with mixed precision their float32 masters (what the
  /// optimizer steps and checkpoints hold).
  std::vector<at::Tensor> parameters() const;
  /// With mixed precision, the float32 master of one of the chunks' parameters; otherwise (or for a parameter
  /// without one: frozen) the tensor itself.
  at::Tensor master_weight(const at::Tensor& parameter) const;
  void zero_grad();
  /// Global gradient norm and the stages with non-finite gradients or losses (one all-reduce of
  /// num_stages + 1 numbers, and of the flags over the data-parallel group, so that every replica decides
  /// alike); every rank must call it, after step().
  GradientCheck check_gradients();
  /// L2 norm of the gradient over ALL ranks' parameters; collective like check_gradients().
  double global_grad_norm() { return check_gradients().norm; }
  /// Scales gradients so that the global norm is at most max_norm; returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  /// The gate in front of the optimizer (collective). Returns true when the optimizer may step: every gradient
  /// and loss is finite (gradients are then clipped to `max_norm` when it is > 0). Otherwise kStop throws
  /// NumericalError naming `step` and the stages, and kSkipStep zeroes the gradients, counts the skip and returns
  /// false, on every rank alike, so no optimizer ever steps on NaN or Inf.
  bool ready_for_optimizer(int step, NonFinitePolicy policy, double max_norm = 0.0);
  int skipped_steps() const { return skipped_steps_; }
  /// What the last ready_for_optimizer() (or check_gradients()) found: the norm before clipping, the stages with
  /// non-finite values. Default-constructed before the first.
  const GradientCheck& last_gradient_check() const { return last_check_; }

 private:
  struct Impl;
  StepResult run_step(const std::function<StepResult()>& run);
  template <typename F>
  auto wait_in(Transport& group, const char* what, F&& collective) -> decltype(collective());
  double run_evaluation(const std::function<StepResult(Executor&)>& run);
  // LossReduction::kMeanOverItems, on the last stage's rank: the global batch's items (`local`, this replica's,
  // summed over the replicas) for mean_loss, and with `scale` the last stage's loss scale 1 / items.
  void count_loss_items(const std::function<double()>& local, bool scale);
  void start_once();
  /// `schedule` as this pipeline runs it: overlapped pairs placed (PipelineOptions::executor.overlap_forward_backward),
  /// then validate()d for the transport's pairing.
  Schedule prepared(Schedule schedule) const;
  /// The executor (and data-parallel reducer) of schedule_, with the hooks of add_hook().
  void build_executor();
  /// UsageError when a failed switch_schedule() left no executor.
  void check_runnable() const;
  /// PipelineOptions::tied_parameters: resolved, checked and synchronised (collective when a tie spans ranks);
  /// aborts the transport when it fails, so that no peer waits for this rank.
  void tie_parameters();
  /// ZeroStage::k2 in effect (a sharding reducer).
  bool sharded() const;
  /// What clipping scales: parameters() and, with ZeRO-2, the shards.
  std::vector<at::Tensor> gradient_holders() const;
  Schedule schedule_;
  std::shared_ptr<Transport> transport_;
  PipelineOptions options_;
  std::map<int, std::unique_ptr<Stage>> stages_;
  std::unique_ptr<Impl> impl_;
  std::vector<double> last_losses_;
  int skipped_steps_ = 0;
  GradientCheck last_check_;
};

}  // namespace twobp
