#include "twobp/runtime/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "runtime/gradient_reducer.h"
#include "runtime/master_weights.h"
#include "runtime/tied_parameters.h"
#include "twobp/schedule/validate.h"
#include "twobp/transport/checksum.h"
#include "util/check.h"
#include "util/failure.h"

namespace twobp {
namespace {

// Clips in place to max_norm given the global norm; a no-op when already within it or when the norm is not finite.
void clip_to(const std::vector<at::Tensor>& params, double norm, double max_norm) {
  if (!(norm > max_norm) || !std::isfinite(norm)) return;
  const double scale = max_norm / (norm + 1e-6);
  c10::AutoGradMode no_grad(false);
  for (const auto& p : params) {
    if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().mul_(scale);
  }
}

// Aborts each non-null transport with `rank`'s failure `e`, so that its peers fail at once instead of at their
// timeouts. A transport already aborted ignores a second abort; an abort that itself fails changes nothing here.
// `executor`: the one whose run `e` may have escaped; where it aborted with a reason of its own (naming the action),
// every group is told that one.
void abort_with(std::initializer_list<Transport*> transports, int rank, const std::exception& e,
                Executor* executor = nullptr) {
  std::string reason = executor != nullptr ? executor->take_failure_reason() : std::string();
  if (reason.empty()) reason = detail::failure_reason(rank, e);
  for (Transport* t : transports) {
    if (t == nullptr) continue;
    try {
      t->abort(reason);
    } catch (...) {
    }
  }
}

// Ranks as threads of one process: refuses a parameter or buffer that chunks of two ranks of `group` share (one
// tensor). Each rank would accumulate into its .grad (or update the buffer) from its own thread, count it in the
// gradient norm, scale it when clipping, step it in its optimizer and save it: once per rank instead of once,
// silently. (Between processes a "tie" is two tensors, which the pipeline cannot see.) Collective over `group`:
// every rank broadcasts the addresses of its tensors in turn -- comparable because the ranks share one address
// space.
void refuse_tensors_shared_with_other_ranks(Transport& group, const std::string& group_name, int pipeline_rank,
                                            const std::map<int, std::unique_ptr<Stage>>& stages, Duration timeout) {
  struct Mine {
    int stage;
    std::string what;  // "parameter 'name'" or "buffer 'name'"
  };
  std::vector<std::int64_t> listed;  // (address, stage) pairs
  std::map<const c10::TensorImpl*, Mine> mine;
  auto add = [&](int stage, const std::string& kind, const std::string& name, const at::Tensor& t) {
    if (!t.defined() || !mine.emplace(t.unsafeGetTensorImpl(), Mine{stage, kind + " '" + name + "'"}).second) return;
    listed.push_back(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(t.unsafeGetTensorImpl())));
    listed.push_back(stage);
  };
  for (const auto& [index, stage] : stages) {
    for (const auto& item : stage->module().named_parameters()) add(index, "parameter", item.key(), item.value());
    for (const auto& item : stage->module().named_buffers()) add(index, "buffer", item.key(), item.value());
  }
  for (int root = 0; root < group.world_size(); ++root) {
    at::Tensor count = at::full({1}, static_cast<std::int64_t>(listed.size()), at::kLong);
    group.broadcast(count, root, timeout);
    at::Tensor theirs = root == group.rank() ? at::tensor(listed, at::kLong)
                                             : at::empty({count.item<std::int64_t>()}, at::kLong);
    group.broadcast(theirs, root, timeout);
    if (root == group.rank()) continue;
    const std::int64_t* data = theirs.data_ptr<std::int64_t>();
    for (std::int64_t k = 0; k + 1 < theirs.numel(); k += 2) {
      auto found = mine.find(reinterpret_cast<const c10::TensorImpl*>(static_cast<std::uintptr_t>(data[k])));
      if (found == mine.end()) continue;
      throw UsageError(fmt::format(
          "rank {}: {} of stage {} is also a tensor of stage {} on {} {}: ranks are threads of one process here, "
          "and a tensor shared by two ranks would be written from two threads (gradients, running statistics), "
          "counted twice in the gradient norm, clipped twice, stepped by both ranks' optimizers and saved twice. "
          "Give each rank its own tensors; to tie a weight across ranks, give each stage a copy and list them in "
          "PipelineOptions::tied_parameters",
          pipeline_rank, found->second.what, found->second.stage, data[k + 1], group_name, root));
    }
  }
}

// Mixed precision and data parallelism fix at construction (and at switch_schedule, for the reducer) which
// parameters train: the float32 masters and the reducer's buckets cover those that required grad then. A
// parameter that requires grad now but is not covered (unfrozen since, or a tensor put in its place) would train
// silently wrong: with mixed precision its bfloat16 gradient reaches no master (the optimizer, built over
// Pipeline::parameters(), steps the masters); with data parallelism it is never averaged over the replicas, which
// drift apart. Refused before the step; freezing (requires_grad true -> false) needs nothing and is supported.
void refuse_parameters_trainable_since_construction(int rank, const std::map<int, std::unique_ptr<Stage>>& stages,
                                                    const detail::MasterWeights* masters,
                                                    const detail::GradientReducer* reducer) {
  for (const auto& [index, stage] : stages) {
    for (const auto& item : stage->module().named_parameters()) {
      const at::Tensor& p = item.value();
      if (!p.requires_grad()) continue;
      const bool no_master = masters != nullptr && !masters->has_master(p);
      const bool not_reduced = reducer != nullptr && !reducer->reduces(p);
      TWOBP_CHECK(!no_master && !not_reduced, UsageError,
                  "rank {} stage {}: parameter '{}' requires grad, but did not (or was another tensor) when this "
                  "Pipeline was built: {}. Set requires_grad before building the Pipeline; to change which "
                  "parameters train later, save a checkpoint and build a new Pipeline over new chunks (freezing a "
                  "parameter needs nothing)",
                  rank, index, item.key(),
                  no_master ? "mixed precision made float32 masters only for the parameters that trained then, so "
                              "its bfloat16 gradient would reach no master and no optimizer step"
                            : "the data-parallel reducer averages only the parameters that trained then, so its "
                              "gradient would differ between the replicas");
    }
  }
}

// Whether an ExecutorOptions field was changed from its default (a hook: whether one is set).
template <typename U>
bool changed_from(const U& value, const U& default_value) {
  return !(value == default_value);
}
template <typename R, typename... A>
bool changed_from(const std::function<R(A...)>& value, const std::function<R(A...)>&) {
  return static_cast<bool>(value);
}

// Moves one deprecated 0.1 field into `target` (ExecutorOptions' field of that name): refused when the executor's
// field was changed from its default too, since the two places would disagree on which value wins.
template <typename T, typename U>
void move_field(MovedToExecutor<T>& old_place, U& target, const U& default_value, const char* name) {
  if (!old_place.assigned()) return;
  TWOBP_CHECK(!changed_from(target, default_value), UsageError,
              "PipelineOptions::{0} (deprecated since 0.2.0) and PipelineOptions::executor.{0} are both set: set "
              "only executor.{0}",
              name);
  target = *old_place.assigned();
  old_place.reset();
}

}  // namespace

PipelineOptions with_moved_executor_options(PipelineOptions options) {
  ExecutorOptions& e = options.executor;
  const ExecutorOptions d;
  move_field(options.timeout, e.timeout, d.timeout, "timeout");
  move_field(options.activation_spec, e.activation_spec, d.activation_spec, "activation_spec");
  move_field(options.boundary_spec, e.boundary_spec, d.boundary_spec, "boundary_spec");
  move_field(options.prefetch_receives, e.prefetch_receives, d.prefetch_receives, "prefetch_receives");
  move_field(options.max_pending_weight_micro_batches, e.max_pending_weight_micro_batches,
             d.max_pending_weight_micro_batches, "max_pending_weight_micro_batches");
  move_field(options.memory_limit_bytes, e.memory_limit_bytes, d.memory_limit_bytes, "memory_limit_bytes");
  move_field(options.record_memory, e.record_memory, d.record_memory, "record_memory");
  move_field(options.overlap_forward_backward, e.overlap_forward_backward, d.overlap_forward_backward,
             "overlap_forward_backward");
  std::optional<c10::Device> device_default;
  MovedToExecutor<std::optional<c10::Device>> device;  // the field is an optional itself in ExecutorOptions
  if (options.memory_device.assigned()) {
    device.assign(*options.memory_device.assigned());
    options.memory_device.reset();
  }
  move_field(device, e.memory_device, device_default, "memory_device");
  return options;
}

struct Pipeline::Impl {
  std::unique_ptr<Executor> executor;
  ExecutorOptions executor_options;                  // the training executor's (the evaluator derives from them)
  std::unique_ptr<Schedule> eval_schedule;           // forward_only(schedule), on the first evaluate()
  std::unique_ptr<Executor> evaluator;
  Executor* on_board = nullptr;                      // the executor whose status the board reads: the last one run
  std::unique_ptr<detail::MasterWeights> masters;    // mixed precision only
  std::unique_ptr<detail::GradientReducer> reducer;  // data parallelism only
  Transport* data_parallel = nullptr;                // the reducer's group
  std::vector<Executor::Hook> hooks;                 // add_hook()'s, in order: kept across switch_schedule()
  bool ranks_share_process = false;                  // some peer (pipeline or replica) is a thread of this process
  bool started = false;                              // a first step began (see run_step)
  std::unique_ptr<detail::TiedParameters> tied;      // PipelineOptions::tied_parameters, when any
  double loss_items = 0.0;  // LossReduction::kMeanOverItems: the last step's (or evaluation's) global items
  bool awaiting_gather = false;  // ZeRO-2: ready_for_optimizer() allowed a step whose shards were not gathered yet
};

Pipeline::Pipeline(Schedule schedule, std::vector<PipelineChunk> chunks, std::shared_ptr<Transport> transport,
                   PipelineOptions options)
    : schedule_(std::move(schedule)),
      transport_(std::move(transport)),
      options_(with_moved_executor_options(std::move(options))),
      impl_(std::make_unique<Impl>()) {
  TWOBP_CHECK(transport_ != nullptr, UsageError, "Pipeline: transport is null");
  if (options_.verify_messages) transport_ = std::make_shared<ChecksummingTransport>(std::move(transport_));
  const int rank = transport_->rank();
  TWOBP_CHECK(transport_->world_size() == schedule_.num_ranks, UsageError,
              "rank {}: schedule '{}' is for {} ranks, but the transport has {}", rank, schedule_.name,
              schedule_.num_ranks, transport_->world_size());
  schedule_ = prepared(std::move(schedule_));
  const std::vector<int> mine = schedule_.stages_of(rank);
  if (options_.mixed_precision.enabled()) {
    const at::ScalarType dtype = options_.mixed_precision.compute_dtype;
    TWOBP_CHECK(dtype == at::kBFloat16, UsageError,
                "rank {}: mixed precision computes in bfloat16; {} is not supported{}", rank, c10::toString(dtype),
                dtype == at::kHalf ? " (float16 needs dynamic loss scaling, which twobp does not have)" : "");
    std::map<int, std::shared_ptr<torch::nn::Module>> modules;  // by stage
    for (const auto& chunk : chunks) {
      TWOBP_CHECK(chunk.module != nullptr, UsageError, "rank {}: the chunk of stage {} has no module", rank,
                  chunk.stage);
      modules.emplace(chunk.stage, chunk.module);
    }
    impl_->masters = std::make_unique<detail::MasterWeights>(modules, dtype, rank);
  }
  // Ranks as threads of this process (pipeline peers or replicas) share LibTorch's default generators.
  impl_->ranks_share_process = transport_->ranks_share_process() ||
                               (options_.data_parallel.group != nullptr &&
                                options_.data_parallel.group->ranks_share_process());
  std::set<int> given;
  for (auto& chunk : chunks) {
    TWOBP_CHECK(std::find(mine.begin(), mine.end(), chunk.stage) != mine.end(), UsageError,
                "rank {}: got a chunk for stage {}, but schedule '{}' places that stage on rank {}", rank, chunk.stage,
                schedule_.name, chunk.stage >= 0 && chunk.stage < schedule_.num_stages
                                    ? schedule_.stage_to_rank[chunk.stage]
                                    : -1);
    TWOBP_CHECK(given.insert(chunk.stage).second, UsageError, "rank {}: two chunks for stage {}", rank, chunk.stage);
    StageOptions so;
    so.stage_index = chunk.stage;
    so.num_stages = schedule_.num_stages;
    so.rank = rank;
    so.batch_weight_grads = options_.batch_weight_grads;
    so.recompute = chunk.recompute;
    so.replay_generators = chunk.replay_generators;
    so.seed = options_.seed;
    so.ranks_share_process = impl_->ranks_share_process;
    if (chunk.stage == schedule_.num_stages - 1) {
      TWOBP_CHECK(static_cast<bool>(options_.loss), UsageError,
                  "rank {}: stage {} is the last stage and needs PipelineOptions::loss", rank, chunk.stage);
      so.loss = options_.loss;
      so.loss_scale = 1.0 / schedule_.num_micro_batches;  // over items: set before each step (count_loss_items)
      TWOBP_CHECK(options_.loss_reduction != LossReduction::kMeanOverItems || options_.loss_items, UsageError,
                  "rank {}: stage {}: LossReduction::kMeanOverItems needs PipelineOptions::loss_items (the number of "
                  "items, e.g. unmasked target tokens, in a batch's targets)",
                  rank, chunk.stage);
    }
    stages_.emplace(chunk.stage, std::make_unique<Stage>(std::move(chunk.module), std::move(chunk.forward), so));
  }
  for (int s : mine) {
    TWOBP_CHECK(given.count(s) != 0, UsageError, "rank {}: schedule '{}' places stage {} on this rank, but no chunk "
                "was given for it", rank, schedule_.name, s);
  }
  const ExecutorOptions& eo = options_.executor;
  TWOBP_CHECK(!(eo.activation_spec && eo.boundary_spec), UsageError,
              "rank {}: give PipelineOptions::executor.activation_spec (one tensor per boundary) or boundary_spec "
              "(several), not both",
              rank);
  TWOBP_CHECK(eo.max_pending_weight_micro_batches >= 0, UsageError,
              "rank {}: PipelineOptions::executor.max_pending_weight_micro_batches must be >= 0 (0: no limit), got {}",
              rank, eo.max_pending_weight_micro_batches);
  TWOBP_CHECK(!eo.run_counter && !eo.parameters_done && !eo.evaluate, UsageError,
              "rank {}: PipelineOptions::executor: run_counter, parameters_done and evaluate are the pipeline's own "
              "(evaluate() runs the forward-only executor; data parallelism reports finished parameters); leave them "
              "unset",
              rank);
  TWOBP_CHECK(options_.data_parallel.zero != ZeroStage::k2 || options_.tied_parameters.empty(), UsageError,
              "rank {}: DataParallelOptions::zero = 2 with PipelineOptions::tied_parameters is not supported yet (the "
              "ties sum full gradients after the step, which ZeRO-2 has released into shards whose layouts differ "
              "between the stages): use zero 0 or 1 with tied weights, or untie them",
              rank);
  build_executor();
  tie_parameters();
}

void Pipeline::tie_parameters() {
  if (options_.tied_parameters.empty()) return;
  try {
    impl_->tied = std::make_unique<detail::TiedParameters>(
        options_.tied_parameters, schedule_, *transport_, stages_,
        [this](const at::Tensor& p) { return master_weight(p); },
        [this](Transport& group, const std::string& what, const std::function<void()>& run) {
          wait_in(group, what.c_str(), run);
        },
        options_.executor.timeout);
  } catch (const std::exception& e) {
    // The other ranks would wait for this one in the ties' collectives until their timeout.
    abort_with({impl_->data_parallel, transport_.get()}, rank(), e);
    throw;
  }
}

Schedule Pipeline::prepared(Schedule schedule) const {
  // Overlapped pairs run at once need both parts' inputs before the F and send both outputs after the B.
  if (options_.executor.overlap_forward_backward) schedule = for_overlapped_pairs(std::move(schedule));
  // Before step 1: a schedule the transport cannot pair (e.g. NCCL, which pairs in posting order per channel)
  // would deliver tensors to the wrong buffers or hang; refuse it here with the offending action marked.
  validate(schedule, transport_->pairing());
  return schedule;
}

void Pipeline::build_executor() {
  const int rank = transport_->rank();
  std::map<int, Stage*> stages;
  for (auto& [index, stage] : stages_) stages.emplace(index, stage.get());
  ExecutorOptions eo = options_.executor;
  Transport* dp = options_.data_parallel.group;
  if (dp != nullptr && dp->world_size() > 1) {
    impl_->data_parallel = dp;
    try {
      // With mixed precision the replicas reduce the float32 masters' gradients (see MixedPrecisionOptions).
      detail::GradientReducer::GradientHolder holder;
      if (impl_->masters) {
        holder = [masters = impl_->masters.get()](const at::Tensor& p) { return masters->master_of(p); };
      }
      impl_->reducer = std::make_unique<detail::GradientReducer>(schedule_, rank, stages, options_.data_parallel,
                                                                 options_.executor.timeout, holder);
      impl_->reducer->track_gradient_peak(true);  // a pass over the holders' .grad per action: cheap
    } catch (const std::exception& e) {
      // Replicas that disagree fail here together, but this rank's pipeline peers may already be waiting in
      // step() for it: tell them now rather than at their timeout.
      abort_with({transport_.get(), dp}, rank, e);
      throw;
    }
  }
  if (impl_->reducer) {
    const bool during_b = options_.data_parallel.start_during_backward;
    const std::vector<Action>* actions = &schedule_.actions[rank];
    std::vector<int> replicas;  // the other replicas' world ranks, for the board
    for (int q = 0; q < dp->world_size(); ++q) {
      if (q != dp->rank()) replicas.push_back(dp->world_rank_of(q));
    }
    eo.parameters_done = [impl = impl_.get(), during_b, actions, replicas](std::size_t index) {
      detail::GradientReducer* reducer = impl->reducer.get();
      // A B given no callback runs fused and its stage's buckets start after it (after_action below).
      if (!during_b && (*actions)[index].type == ActionType::kBackward) return autograd::ParametersDone();
      autograd::ParametersDone done = reducer->parameters_done(index);
      if (!done || !reducer->blocking_start_after(index)) return done;
      // ZeRO-2 on a blocking transport: the reduce-scatters this callback may start block inside the action; the
      // board shows them as a wait with the other replicas, then the action again.
      const Action* action = &(*actions)[index];
      return autograd::ParametersDone([impl, done, action, replicas](const std::vector<at::Tensor>& params) {
        impl->executor->note_collective_wait("the ZeRO-2 reduce-scatters of stage " + std::to_string(action->stage) +
                                                 "'s gradients, inside its last weight action",
                                             replicas);
        done(params);
        impl->executor->note_computing(*action);
      });
    };
  }
  // One run count for the training and evaluation executors, kept across switch_schedule(): their messages
  // stay apart (message_tag_span).
  if (!impl_->executor_options.run_counter) impl_->executor_options.run_counter = std::make_shared<std::int64_t>(0);
  eo.run_counter = impl_->executor_options.run_counter;
  impl_->executor_options = eo;
  impl_->executor = std::make_unique<Executor>(schedule_, rank, std::move(stages), *transport_, std::move(eo));
  impl_->on_board = impl_->executor.get();  // an executor shows its status from its construction on
  if (impl_->reducer) {
    // First hook: a bucket starts right after its stage's last weight action, before any user hook runs.
    const Action* first = schedule_.actions[rank].data();
    std::vector<int> replicas;  // the other replicas' world ranks, for the board
    for (int q = 0; q < dp->world_size(); ++q) {
      if (q != dp->rank()) replicas.push_back(dp->world_rank_of(q));
    }
    impl_->executor->add_hook([reducer = impl_->reducer.get(), first, executor = impl_->executor.get(),
                               replicas](const ActionEvent& event) {
      const auto index = static_cast<std::size_t>(event.action - first);
      // ZeRO-2 on a blocking transport reduce-scatters here, inside the step: a wait on the board (the next
      // action's status replaces it).
      if (reducer->blocking_start_after(index)) {
        executor->note_collective_wait("the ZeRO-2 reduce-scatter of stage " + std::to_string(event.action->stage) +
                                           "'s gradients",
                                       replicas);
      }
      reducer->after_action(index);
    });
  }
  for (const Executor::Hook& hook : impl_->hooks) impl_->executor->add_hook(hook);
}

void Pipeline::switch_schedule(Schedule next) {
  const int rank = transport_->rank();
  const Schedule& now = schedule_;
  TWOBP_CHECK(next.num_ranks == now.num_ranks && next.num_stages == now.num_stages &&
                  next.stage_to_rank == now.stage_to_rank,
              UsageError,
              "rank {}: switch_schedule: '{}' places {} stages on {} ranks as [{}], the running '{}' as [{}] on {}; a "
              "switch keeps every stage on its rank (candidates: schedules with the same placement). To move stages, "
              "build a new Pipeline and load a checkpoint",
              rank, next.name, next.num_stages, next.num_ranks, fmt::join(next.stage_to_rank, ","), now.name,
              fmt::join(now.stage_to_rank, ","), now.num_ranks);
  TWOBP_CHECK(next.num_micro_batches == now.num_micro_batches, UsageError,
              "rank {}: switch_schedule: '{}' has {} micro-batches, the running '{}' {}; the loss of each counts "
              "1/micro-batches, so a switch keeps their number",
              rank, next.name, next.num_micro_batches, now.name, now.num_micro_batches);
  TWOBP_CHECK(!(impl_->reducer && impl_->reducer->sharded()), UsageError,
              "rank {}: switch_schedule with DataParallelOptions::zero = 2 is not supported: the flat gradient "
              "shards follow the running schedule's bucket order, and the optimizer's shard state is keyed to them. "
              "Save a checkpoint and build a new Pipeline with '{}'",
              rank, next.name);
  Schedule ready = prepared(std::move(next));  // refused here leaves the running schedule in place
  // What refers to the running schedule goes first: the executors (which call the reducer), then the reducer.
  impl_->on_board = nullptr;
  impl_->evaluator.reset();
  impl_->eval_schedule.reset();
  impl_->executor.reset();
  impl_->reducer.reset();
  schedule_ = std::move(ready);
  try {
    build_executor();
  } catch (const std::exception& e) {
    // A rank whose switch failed cannot step; its peers (which may have switched) must not wait for it.
    abort_with({transport_.get(), impl_->data_parallel}, rank, e);
    throw;
  }
}

void Pipeline::check_runnable() const {
  TWOBP_CHECK(impl_->executor != nullptr, UsageError,
              "rank {}: a failed switch_schedule() to '{}' left this pipeline without an executor (its transports "
              "were aborted); build a new Pipeline",
              rank(), schedule_.name);
}

Pipeline::Pipeline(Schedule schedule, std::vector<PipelineChunk> chunks, Transport& transport, PipelineOptions options)
    : Pipeline(std::move(schedule), std::move(chunks), std::shared_ptr<Transport>(&transport, [](Transport*) {}),
               std::move(options)) {}

Pipeline::~Pipeline() = default;

Stage& Pipeline::stage(int index) {
  auto it = stages_.find(index);
  TWOBP_CHECK(it != stages_.end(), UsageError, "rank {}: stage {} is not on this rank", rank(), index);
  return *it->second;
}

std::vector<int> Pipeline::stage_indices() const {
  std::vector<int> out;
  for (const auto& [s, st] : stages_) out.push_back(s);
  return out;
}

std::vector<at::Tensor> Pipeline::parameters() const {
  std::vector<at::Tensor> params;
  for (const auto& [s, st] : stages_) {
    for (auto& p : st->parameters()) params.push_back(p);
  }
  // A weight tied between two chunks of this rank (zb-v puts the first and the last stage on rank 0) is one
  // parameter: counting it twice would double it in the norm and scale it twice when clipping.
  if (impl_->masters) {
    for (auto& p : params) p = impl_->masters->master_of(p);
  }
  return unique_tensors(params);
}

at::Tensor Pipeline::master_weight(const at::Tensor& parameter) const {
  return impl_->masters ? impl_->masters->master_of(parameter) : parameter;
}

void Pipeline::zero_grad() {
  for (auto& p : parameters()) p.mutable_grad().reset();
  if (impl_->reducer && impl_->reducer->sharded()) impl_->reducer->zero_shard_grads();
  if (impl_->masters) {
    // The compute parameters' .grad is moved out at every accumulation; reset it too after a failed step.
    for (const auto& [s, st] : stages_) {
      for (auto& p : st->parameters()) p.mutable_grad().reset();
    }
  }
}

GradientCheck Pipeline::check_gradients() {
  // Per stage of this rank: the sum of squares of its gradients, computed where they live (one fused norm per
  // (device, dtype) group, accumulated in float32 for 16- and 32-bit gradients and float64 for float64, as
  // torch.nn.utils.clip_grad_norm_ does), then ONE copy of those few numbers to the host. A non-finite sum marks
  // the stage; so does a gradient whose squares overflow the accumulation (|g| above ~1e19 in float32).
  std::vector<at::Tensor> stage_sq;  // one 0-dim float64 tensor per stage of this rank, on the stage's device
  // Each parameter is counted once, in the first of this rank's stages that lists it; a tied weight once, as its
  // first copy (PipelineOptions::tied_parameters).
  std::unordered_set<const c10::TensorImpl*> counted;
  if (impl_->tied) counted = impl_->tied->duplicates();
  {
    c10::AutoGradMode no_grad(false);
    for (const auto& [index, stage_ptr] : stages_) {
      std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
      c10::Device device(c10::kCPU);  // where this stage's gradients are (no gradient: the host)
      std::vector<at::Tensor> holders;
      for (const auto& compute : stage_ptr->parameters()) holders.push_back(master_weight(compute));
      if (sharded()) {
        // ZeRO-2: the averaged gradient exists as this replica's shards (the full .grad were released); the
        // replicas' sums of squares are added by the all-reduce over the group below.
        const auto shards = impl_->reducer->shards();
        for (std::size_t k = 0; k < shards.size(); ++k) {
          if (impl_->reducer->shard_stage(k) == index) holders.push_back(shards[k]);
        }
      }
      for (const auto& p : holders) {
        if (!p.grad().defined() || !counted.insert(p.unsafeGetTensorImpl()).second) continue;
        // A sparse gradient may hold one index several times: coalesce (sum duplicates) before squaring.
        at::Tensor g = p.grad().is_sparse() ? p.grad().coalesce().values() : p.grad();
        const at::ScalarType acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
        device = g.device();
        groups[{g.device().str(), acc}].push_back(std::move(g));
      }
      at::Tensor sq = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
      for (const auto& [key, grads] : groups) {
        const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, key.second);
        sq = sq + at::stack(norms).to(device, at::kDouble).pow(2).sum();
      }
      stage_sq.push_back(sq);
    }
  }
  // SYNC POINT (documented: one per step): the per-stage sums reach the host together (one copy per device;
  // a rank's stages normally share one).
  std::map<std::string, std::vector<std::int64_t>> by_device;
  for (std::size_t k = 0; k < stage_sq.size(); ++k) by_device[stage_sq[k].device().str()].push_back(k);
  std::vector<double> host_sq(stage_sq.size(), 0.0);
  for (const auto& [device, ks] : by_device) {
    std::vector<at::Tensor> part;
    for (auto k : ks) part.push_back(stage_sq[k]);
    const at::Tensor values = at::stack(part).to(at::kCPU).contiguous();
    for (std::size_t j = 0; j < ks.size(); ++j) host_sq[ks[j]] = values.data_ptr<double>()[j];
  }
  // [sum of squares, then one non-finite flag per stage]: one all-reduce gives every rank the same verdict. On
  // the CPU: every transport reduces host tensors (no device round trip for a handful of numbers).
  at::Tensor total = at::zeros({schedule_.num_stages + 1}, at::kDouble);
  double* local = total.data_ptr<double>();
  std::size_t k = 0;
  for (const auto& [index, stage_ptr] : stages_) {
    const double sq = host_sq[k++];
    bool bad = !std::isfinite(sq);
    if (index == schedule_.num_stages - 1) {
      for (double l : last_losses_) bad = bad || !std::isfinite(l);
    }
    local[0] += sq;
    local[index + 1] = bad ? 1.0 : 0.0;
  }
  wait_in(*transport_, "the gradient check over the pipeline",
          [&] { transport_->all_reduce_sum(total, options_.executor.timeout); });
  if (sharded()) {
    // ZeRO-2: the sums of squares of the replicas' shards add up to the global norm's square; the flags too.
    wait_in(*impl_->data_parallel, "the gradient check over the replicas",
            [&] { impl_->data_parallel->all_reduce_sum(total, options_.executor.timeout); });
  } else if (impl_->data_parallel != nullptr) {
    // The flags over the replicas too (the norm is already the same on every replica: gradients are averaged).
    at::Tensor flags = total.narrow(0, 1, schedule_.num_stages).clone();
    wait_in(*impl_->data_parallel, "the gradient check over the replicas",
            [&] { impl_->data_parallel->all_reduce_sum(flags, options_.executor.timeout); });
    total.narrow(0, 1, schedule_.num_stages).copy_(flags);
  }
  GradientCheck check;
  check.norm = std::sqrt(total[0].item<double>());
  for (int s = 0; s < schedule_.num_stages; ++s) {
    if (total[s + 1].item<double>() != 0.0) check.non_finite_stages.push_back(s);
  }
  last_check_ = check;
  return check;
}

bool Pipeline::ready_for_optimizer(int step, NonFinitePolicy policy, double max_norm) {
  GradientCheck check;
  try {
    check = check_gradients();
  } catch (const std::exception& e) {
    // A peer that failed before this collective aborted it: report its error's type, as step() does.
    if (std::exception_ptr root = detail::as_root_type(e)) std::rethrow_exception(root);
    throw;
  }
  if (!check.finite()) {
    TWOBP_CHECK(policy != NonFinitePolicy::kStop, NumericalError,
                "rank {}: step {}: non-finite loss or gradient in stage(s) {}; no optimizer step was taken", rank(),
                step, fmt::join(check.non_finite_stages, ", "));
    zero_grad();
    ++skipped_steps_;
    return false;
  }
  if (max_norm > 0.0) clip_to(gradient_holders(), check.norm, max_norm);
  if (sharded()) impl_->awaiting_gather = true;
  return true;
}

double Pipeline::clip_grad_norm(double max_norm) {
  const double norm = global_grad_norm();
  clip_to(gradient_holders(), norm, max_norm);
  return norm;
}

bool Pipeline::sharded() const { return impl_->reducer != nullptr && impl_->reducer->sharded(); }

std::vector<at::Tensor> Pipeline::gradient_holders() const {
  std::vector<at::Tensor> out = parameters();
  if (sharded()) {
    for (const auto& shard : impl_->reducer->shards()) out.push_back(shard);
  }
  return out;
}

ZeroStage Pipeline::zero_stage() const { return sharded() ? ZeroStage::k2 : options_.data_parallel.zero; }

std::vector<at::Tensor> Pipeline::parameter_shards() const {
  return sharded() ? impl_->reducer->shards() : std::vector<at::Tensor>{};
}

std::vector<ParameterShardSlice> Pipeline::parameter_shard_layout() const {
  std::vector<ParameterShardSlice> out;
  if (!sharded()) return out;
  for (const auto& slice : impl_->reducer->layout()) {
    const ShardRange range = impl_->reducer->shard_range_of(slice.bucket);
    // The part of [offset, offset + numel) that falls in this replica's range.
    const std::int64_t begin = std::max(slice.offset, range.begin);
    const std::int64_t end = std::min(slice.offset + slice.holder.numel(), range.end);
    if (begin >= end) continue;
    out.push_back(ParameterShardSlice{slice.holder, slice.bucket, begin - slice.offset, begin - range.begin,
                                      end - begin});
  }
  return out;
}

void Pipeline::gather_parameter_shards() {
  check_runnable();
  TWOBP_CHECK(sharded(), UsageError,
              "rank {}: gather_parameter_shards needs data parallelism with DataParallelOptions::zero = 2", rank());
  try {
    wait_in(*impl_->data_parallel, "the ZeRO-2 all-gather of the updated parameters",
            [&] { impl_->reducer->gather_shards(); });
  } catch (const std::exception& e) {
    abort_with({impl_->data_parallel, transport_.get()}, rank(), e);
    if (std::exception_ptr root = detail::as_root_type(e)) std::rethrow_exception(root);
    throw;
  }
  impl_->awaiting_gather = false;
}

std::int64_t Pipeline::data_parallel_bytes_sent() const {
  return impl_->reducer ? impl_->reducer->bytes_sent() : 0;
}

ReplicaMemory Pipeline::replica_memory() const {
  ReplicaMemory m;
  auto bytes = [](const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); };
  std::vector<at::Tensor> compute;
  for (const auto& [s, st] : stages_) {
    for (const auto& p : st->parameters()) {
      if (p.requires_grad()) compute.push_back(p);
    }
  }
  for (const auto& p : unique_tensors(compute)) {
    m.parameters += bytes(p);
    if (impl_->masters && impl_->masters->has_master(p)) m.masters += bytes(impl_->masters->master_of(p));
  }
  if (impl_->reducer) m.gradient_peak = impl_->reducer->gradient_peak_bytes();
  m.bytes_sent = data_parallel_bytes_sent();
  return m;
}

namespace {

// Mixed precision: the first stage's floating-point inputs in the compute dtype (ids and masks stay).
NamedTensors in_compute_dtype(const NamedTensors& inputs, const MixedPrecisionOptions& mp) {
  if (!mp.enabled()) return inputs;
  NamedTensors out = inputs;
  for (auto& e : out) {
    if (e.tensor.defined() && e.tensor.is_floating_point()) e.tensor = e.tensor.to(mp.compute_dtype);
  }
  return out;
}

}  // namespace

namespace {

// The items of a step's targets (LossReduction::kMeanOverItems): PipelineOptions::loss_items over the whole batch or
// summed over the micro-batches given one by one.
double items_of(const PipelineOptions& o, const NamedTensors& targets) { return o.loss_items(targets); }
double items_of(const PipelineOptions& o, const std::vector<NamedTensors>& targets) {
  double sum = 0.0;
  for (const auto& mb : targets) sum += o.loss_items(mb);
  return sum;
}

}  // namespace

void Pipeline::count_loss_items(const std::function<double()>& local, bool scale) {
  const int last = schedule_.num_stages - 1;
  const auto it = stages_.find(last);
  if (options_.loss_reduction != LossReduction::kMeanOverItems || it == stages_.end()) return;
  const double mine = local();
  TWOBP_CHECK(std::isfinite(mine) && mine >= 0, UsageError,
              "rank {}: stage {}: PipelineOptions::loss_items gave {} for this step's targets; expected a count >= 0",
              rank(), last, mine);
  at::Tensor items = at::tensor({mine}, at::TensorOptions().dtype(at::kDouble));
  if (impl_->data_parallel != nullptr) {
    wait_in(*impl_->data_parallel, "the global count of loss items",
            [&] { impl_->data_parallel->all_reduce_sum(items, options_.executor.timeout); });
  }
  impl_->loss_items = items.item<double>();
  TWOBP_CHECK(impl_->loss_items > 0, UsageError,
              "rank {}: stage {}: the global batch holds no loss item (PipelineOptions::loss_items summed over the "
              "micro-batches and replicas is 0): a mean over items needs at least one",
              rank(), last);
  // The replicas' gradients are averaged (GradientReducer: the sum / dp), but over items each replica's share is a
  // part of one sum: seeded dp times larger, their average is that sum.
  const int replicas = impl_->data_parallel != nullptr ? impl_->data_parallel->world_size() : 1;
  if (scale) it->second->set_loss_scale(static_cast<double>(replicas) / impl_->loss_items);
}

StepResult Pipeline::step(const NamedTensors& inputs, const NamedTensors& targets) {
  return run_step([&] {
    count_loss_items([&] { return items_of(options_, targets); }, /*scale=*/true);
    return impl_->executor->run(in_compute_dtype(inputs, options_.mixed_precision), targets);
  });
}

StepResult Pipeline::step(const std::vector<NamedTensors>& inputs, const std::vector<NamedTensors>& targets) {
  return run_step([&] {
    count_loss_items([&] { return items_of(options_, targets); }, /*scale=*/true);
    std::vector<NamedTensors> cast;
    for (const auto& mb : inputs) cast.push_back(in_compute_dtype(mb, options_.mixed_precision));
    return impl_->executor->run(cast, targets);
  });
}

void Pipeline::start_once() {
  if (!impl_->started && impl_->ranks_share_process) {
    // SYNC POINT, once: ranks as threads start their first forward only when every rank thread got here, i.e.
    // has built its chunks. Building modules draws from LibTorch's default generator (their default
    // initialisation); a forward running meanwhile on another thread would see that generator move and be
    // refused (Stage: ranks_share_process), although its own draws are fine.
    try {
      transport_->barrier(options_.executor.timeout);
      if (impl_->data_parallel != nullptr) impl_->data_parallel->barrier(options_.executor.timeout);
      if (transport_->ranks_share_process()) {
        refuse_tensors_shared_with_other_ranks(*transport_, "pipeline rank", rank(), stages_,
                                               options_.executor.timeout);
      }
      if (impl_->data_parallel != nullptr && impl_->data_parallel->ranks_share_process()) {
        refuse_tensors_shared_with_other_ranks(*impl_->data_parallel, "data-parallel replica", rank(), stages_,
                                               options_.executor.timeout);
      }
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("rank {}: the first step starts when every rank thread has reached it, "
                                     "before micro-batch 0 of any stage: {}", rank(), e.what()));
    }
  }
  impl_->started = true;
}

// A blocking collective of the step over `group`, shown on the status board as a wait in `what` with the group's
// other ranks (by the executor that ran last: the board reads its status); when it times out on this rank, its error
// carries the job-wide hang report (and so does the abort that follows). Returns what `collective` returns.
template <typename F>
auto Pipeline::wait_in(Transport& group, const char* what, F&& collective) -> decltype(collective()) {
  std::vector<int> others;
  for (int q = 0; q < group.world_size(); ++q) {
    if (q != group.rank()) others.push_back(group.world_rank_of(q));
  }
  Executor& executor = *impl_->on_board;
  executor.note_collective_wait(what, std::move(others));
  try {
    if constexpr (std::is_void_v<decltype(collective())>) {
      collective();
      executor.note_outside_step();
    } else {
      auto result = collective();
      executor.note_outside_step();
      return result;
    }
  } catch (const TimeoutError& e) {
    // This rank stays "waiting" on the board: the edge a later report needs (as the executor's own waits).
    if (dynamic_cast<const RaisedOnAnotherRank*>(&e) != nullptr) throw;
    const std::string report = executor.hang_report_for();
    if (report.empty()) throw;
    throw TimeoutError(fmt::format("{}\n{}", e.what(), report));
  }
}

void Pipeline::run_collective(Transport& group, const std::string& what, const std::function<void()>& collective) {
  check_runnable();
  wait_in(group, what.c_str(), collective);
}

StepResult Pipeline::run_step(const std::function<StepResult()>& run) {
  const auto t0 = std::chrono::steady_clock::now();
  StepResult result;
  check_runnable();
  // ZeRO-2: the last ready_for_optimizer() let an optimizer step, but the updated shards never came back: an
  // optimizer over parameters() sees no gradient (the full .grad were released) and would silently not train.
  // Every rank decides alike (the gate's verdict is the same everywhere), so no peer waits for this one.
  TWOBP_CHECK(!impl_->awaiting_gather, UsageError,
              "rank {}: with DataParallelOptions::zero = 2 the gradients exist only as shards: step with "
              "ShardedOptimizer(pipeline, factory) (it steps the shards and all-gathers them), not an optimizer "
              "over Pipeline::parameters()",
              rank());
  try {
    if (impl_->masters || impl_->reducer) {
      refuse_parameters_trainable_since_construction(rank(), stages_, impl_->masters.get(), impl_->reducer.get());
    }

    start_once();
    if (impl_->reducer) impl_->reducer->begin_step();
    if (impl_->masters) impl_->masters->sync();  // what the optimizer did to the masters, for this step's compute
    impl_->on_board = impl_->executor.get();
    result = run();
    if (impl_->reducer) {
      result.reduce_wait_us = wait_in(*impl_->data_parallel, "the data-parallel gradient reduction",
                                      [&] { return impl_->reducer->finish(); });
    }
    if (impl_->tied) {
      impl_->tied->sum_gradients(
          [this](Transport& group, const std::string& what, const std::function<void()>& collective) {
            wait_in(group, what.c_str(), collective);
          },
          options_.executor.timeout);
    }
  } catch (const std::exception& e) {
    if (impl_->reducer) impl_->reducer->reset();
    // The other ranks and replicas would otherwise wait for this one (its messages, its reductions, its next step:
    // an error before the first action, e.g. a refused shared tensor, or after the last, e.g. a refused buffer)
    // until their timeouts. The executor already aborted the pipeline transport for an error inside an action.
    abort_with({impl_->data_parallel, transport_.get()}, rank(), e, impl_->executor.get());
    if (std::exception_ptr root = detail::as_root_type(e)) std::rethrow_exception(root);
    throw;
  }
  last_losses_ = result.losses;
  result.pipeline_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

namespace {

// Puts modules in eval() mode until destroyed, then restores every submodule's own train/eval flag (parents
// first: Module::train() recurses, and a child's restore must come after its parent's).
class EvalMode {
 public:
  explicit EvalMode(const std::vector<torch::nn::Module*>& roots) {
    for (torch::nn::Module* root : roots) {
      saved_.emplace_back(root, root->is_training());
      for (const auto& m : root->modules(/*include_self=*/false)) saved_.emplace_back(m.get(), m->is_training());
    }
    for (torch::nn::Module* root : roots) root->eval();
  }
  ~EvalMode() {
    for (auto& [m, training] : saved_) m->train(training);
  }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  std::vector<std::pair<torch::nn::Module*, bool>> saved_;
};

}  // namespace

double Pipeline::evaluate(const NamedTensors& inputs, const NamedTensors& targets) {
  return run_evaluation([&](Executor& e) {
    count_loss_items([&] { return items_of(options_, targets); }, /*scale=*/false);
    return e.run(in_compute_dtype(inputs, options_.mixed_precision), targets);
  });
}

double Pipeline::evaluate(const std::vector<NamedTensors>& inputs, const std::vector<NamedTensors>& targets) {
  return run_evaluation([&](Executor& e) {
    count_loss_items([&] { return items_of(options_, targets); }, /*scale=*/false);
    std::vector<NamedTensors> cast;
    for (const auto& mb : inputs) cast.push_back(in_compute_dtype(mb, options_.mixed_precision));
    return e.run(cast, targets);
  });
}

double Pipeline::run_evaluation(const std::function<StepResult(Executor&)>& run) {
  check_runnable();
  try {
    if (!impl_->evaluator) {
      // The training executor's settings without what only training needs: memory bounds act on deferred W's,
      // and no gradient is reduced.
      ExecutorOptions eo = impl_->executor_options;
      eo.evaluate = true;
      eo.parameters_done = nullptr;
      eo.max_pending_weight_micro_batches = 0;
      eo.memory_limit_bytes = 0;
      eo.record_memory = false;
      std::map<int, Stage*> stages;
      for (auto& [index, stage] : stages_) stages.emplace(index, stage.get());
      impl_->eval_schedule = std::make_unique<Schedule>(forward_only(schedule_));
      impl_->evaluator = std::make_unique<Executor>(*impl_->eval_schedule, rank(), std::move(stages), *transport_,
                                                    std::move(eo));
    }
    start_once();
    if (impl_->masters) impl_->masters->sync();  // the optimizer's latest masters, as a step would compute with
    std::vector<torch::nn::Module*> modules;
    for (auto& [index, stage] : stages_) modules.push_back(&stage->module());
    StepResult result;
    {
      EvalMode eval(modules);
      impl_->on_board = impl_->evaluator.get();  // mean_loss below then waits on the evaluator's run
      result = run(*impl_->evaluator);
    }
    return mean_loss(result);
  } catch (const std::exception& e) {
    // As in run_step: the peers would otherwise wait for this rank (its messages, mean_loss's reductions) until
    // their timeouts -- after an error before the first action (a refused master sync) or after the last.
    abort_with({impl_->data_parallel, transport_.get()}, rank(), e, impl_->evaluator.get());
    if (std::exception_ptr root = detail::as_root_type(e)) std::rethrow_exception(root);
    throw;
  }
}

void Pipeline::add_hook(Executor::Hook hook) {
  check_runnable();
  impl_->hooks.push_back(hook);
  impl_->executor->add_hook(std::move(hook));
}

double Pipeline::mean_loss(const StepResult& result) {
  // Only the last stage's rank has losses; one all-reduce gives every rank their mean. Over items: the losses are
  // sums, the step's items counted before it (count_loss_items), and the replicas' shares add up.
  const bool over_items = options_.loss_reduction == LossReduction::kMeanOverItems;
  double local = 0.0;
  for (double l : result.losses) {
    local += over_items ? l / impl_->loss_items : l / static_cast<double>(result.losses.size());
  }
  at::Tensor t = at::tensor({local}, at::TensorOptions().dtype(at::kDouble));  // host values: reduced on the host
  wait_in(*transport_, "the mean loss over the pipeline",
          [&] { transport_->all_reduce_sum(t, options_.executor.timeout); });
  if (impl_->data_parallel != nullptr) {
    wait_in(*impl_->data_parallel, "the mean loss over the replicas",
            [&] { impl_->data_parallel->all_reduce_sum(t, options_.executor.timeout); });
    if (!over_items) t.div_(impl_->data_parallel->world_size());
  }
  return t.item<double>();
}

}  // namespace twobp
