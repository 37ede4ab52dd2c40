#pragma once
// ZeRO stage 1 over the data-parallel group: each replica keeps the optimizer state of a share of the parameters
// only, steps that share, and the updated values reach the other replicas by broadcast.
//
// Scheme (PyTorch's ZeroRedundancyOptimizer): parameters are assigned whole to replicas, greedily by size (largest
// first, to the replica with the fewest elements so far; ties to the lowest replica), the same on every replica
// because every replica holds the same parameters in the same order (the Pipeline's constructor checks that).
// Gradients stay averaged by the Pipeline's bucketed all-reduce (hidden in W), so clipping and the optimizer gate
// see the full gradients on every replica, as without sharding; step() then runs the local optimizer over this
// replica's share and broadcasts every share from its owner (one broadcast per owner and dtype).
// WHY not reduce-scatter + all-gather (Megatron's distributed optimizer): it halves the gradient traffic, but the
// transports have no reduce-scatter yet and the gate and clipping would need the norm of sharded gradients; the
// memory saved is the same: optimizer state / dp per replica.
//
// What is sharded: the optimizer's state (AdamW: exp_avg and exp_avg_sq, 8 bytes per float32 parameter). Not the
// parameters, the gradients or, with mixed precision, the float32 masters (every replica keeps all of them).
// A replica that owns no parameter (more replicas than parameters) has no local optimizer and steps nothing.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "twobp/transport/transport.h"

namespace twobp {

class Pipeline;  // twobp/runtime/pipeline.h

class ShardedOptimizer {
 public:
  /// Makes the local optimizer over the parameters this replica owns (never called with an empty list).
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> owned)>;

  /// `params`: what the optimizer steps (Pipeline::parameters(): with mixed precision the masters), identical in
  /// number, shapes and order on every replica; parameters that do not require grad are assigned to nobody and
  /// never change (step() refuses one that requires grad later: build a new optimizer then). `group`: the
  /// data-parallel group (ParallelGroups::data_parallel()); null or of size 1: this replica owns everything (a
  /// plain optimizer). Local: no communication until step().
  ShardedOptimizer(std::vector<at::Tensor> params, Transport* group, const Factory& make, Duration timeout);
  /// The same over `pipeline`'s parameters (Pipeline::parameters()) and data-parallel group
  /// (PipelineOptions::data_parallel.group), with its timeout (executor.timeout); the way to build it in a job.
  /// Its collectives -- step()'s broadcasts, gathered_adamw_state() -- are then waits on the status board
  /// (Pipeline::run_collective), so that a replica that never joins them is named in the one job-wide hang report.
  /// `pipeline` must outlive it.
  ShardedOptimizer(Pipeline& pipeline, const Factory& make);
  ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  /// Collective over the group: steps this replica's share with the local optimizer, then gives every replica
  /// every updated parameter. Call it on every replica, after the same gate decision (Pipeline's
  /// ready_for_optimizer decides alike everywhere).
  void step();

  /// The optimizer over this replica's share (to set learning rates), null when it owns nothing.
  torch::optim::Optimizer* local() { return local_.get(); }
  /// Sets the learning rate of every parameter group of the local optimizer (none when it owns nothing). Local:
  /// every replica sets the same rate for the same step.
  void set_lr(double lr);
  /// The replica that steps `param` (-1: nobody, it does not require grad). Throws UsageError for a tensor that
  /// is not one of `params`.
  int owner_of(const at::Tensor& param) const;
  int replica() const { return replica_; }
  int replicas() const { return replicas_; }
  /// Bytes of this replica's optimizer state: the moment tensors of AdamW and Adam, the momentum of SGD (the
  /// optimizers it knows; UsageError for another's state). 0 when it owns nothing or nothing was stepped yet.
  int64_t state_bytes() const;

  /// Checkpoints (AdamW only): the state of every named parameter on every replica, as
  /// checkpoint::adamw_state_tensors names it (twobp/runtime/training_state.h) -- collective over the group (each
  /// owner broadcasts its share; every replica then holds the whole state until the result is dropped). `params`:
  /// (name, parameter) pairs covering the parameters given at construction. UsageError if the local optimizer is
  /// not an AdamW or uses amsgrad.
  std::vector<std::pair<std::string, at::Tensor>> gathered_adamw_state(
      const std::vector<std::pair<std::string, at::Tensor>>& params);
  /// Restores the AdamW state of this replica's share from a full checkpoint (`loaded`: every parameter's state,
  /// as gathered_adamw_state wrote it); the weights are restored by checkpoint::restore. Local. The state is copied
  /// (checkpoint::restore): later steps do not change the caller's `loaded` tensors.
  void restore_adamw_state(const std::vector<std::pair<std::string, at::Tensor>>& loaded,
                           const std::vector<std::pair<std::string, at::Tensor>>& params);

 private:
  std::vector<at::Tensor> params_;
  std::vector<int> owner_;  // by parameter index
  std::unordered_map<const c10::TensorImpl*, std::size_t> index_;
  /// Runs the collective `body` over group_ (with replicas), as a wait on pipeline_'s board when built from one.
  void collective(const char* what, const std::function<void()>& body);

  Transport* group_;
  Pipeline* pipeline_ = nullptr;
  int replica_ = 0;
  int replicas_ = 1;
  Duration timeout_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

}  // namespace twobp
