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
// ZeRO-1 keeps the all-reduce so that the gate and clipping see full gradients and any optimizer works per whole
// parameter; the reduce-scatter + all-gather scheme (less traffic, gradients sharded too) is ZeRO-2, below.
//
// What is sharded: the optimizer's state (AdamW: exp_avg and exp_avg_sq, 8 bytes per float32 parameter). Not the
// parameters, the gradients or, with mixed precision, the float32 masters (every replica keeps all of them).
// A replica that owns no parameter (more replicas than parameters) has no local optimizer and steps nothing.
//
// ZeRO-2 (DataParallelOptions::zero = ZeroStage::k2, built from the Pipeline): the Pipeline already left each
// replica its shard of every flat bucket's averaged gradient (Pipeline::parameter_shards()); the local optimizer is
// made over those shards (every replica has one; a shard may be empty), step() steps them -- in place in the
// working weights (masters) -- and all-gathers them (Pipeline::gather_parameter_shards). The optimizer state is
// then sharded by elements (dp-th of every bucket), not by whole parameters.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "twobp/runtime/data_parallel.h"
#include "twobp/transport/transport.h"

namespace twobp {

class Pipeline;  // twobp/runtime/pipeline.h
struct ReplicaMemory;  // twobp/runtime/pipeline.h

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
  /// `pipeline` must outlive it. With the pipeline at ZeroStage::k2 it steps the pipeline's gradient shards (see the
  /// top of this file); the factory then gets the shards (flat tensors, possibly empty).
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
  /// The replica that steps `param` (-1: nobody, it does not require grad; under ZeRO-2 always -1: every replica
  /// steps its shard of it). Throws UsageError for a tensor that is not one of `params`.
  int owner_of(const at::Tensor& param) const;
  int replica() const { return replica_; }
  /// The ZeRO stage it runs: k2 over a pipeline at k2, else k1 (k0 with one replica: a plain optimizer).
  ZeroStage stage() const { return zero2_ ? ZeroStage::k2 : replicas_ > 1 ? ZeroStage::k1 : ZeroStage::k0; }
  /// Bytes this replica sent in the last step()'s broadcasts (ZeRO-1; collective_bytes_sent's ring formula). 0 for
  /// ZeRO-2, whose all-gather Pipeline::data_parallel_bytes_sent() counts.
  std::int64_t bytes_sent() const { return bytes_sent_; }
  int replicas() const { return replicas_; }
  /// Bytes of this replica's optimizer state: the moment tensors of AdamW and Adam, the momentum of SGD (the
  /// optimizers it knows; UsageError for another's state). 0 when it owns nothing or nothing was stepped yet.
  int64_t state_bytes() const;

  /// Checkpoints (AdamW only; under ZeRO-2 the shards' state put back into every parameter's shape, by one sum over
  /// the replicas of their disjoint slices): the state of every named parameter on every replica, as
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

  /// ZeRO-1: assigns whole parameters to replicas and makes the local optimizer over this replica's.
  void assign_owners(const Factory& make);
  /// ZeRO-2 checkpoints: the shard state of every named parameter, gathered (see gathered_adamw_state).
  std::vector<std::pair<std::string, at::Tensor>> gathered_zero2_state(
      const std::vector<std::pair<std::string, at::Tensor>>& params);
  void restore_zero2_state(const std::vector<std::pair<std::string, at::Tensor>>& loaded,
                           const std::vector<std::pair<std::string, at::Tensor>>& params);

  bool zero2_ = false;
  std::int64_t bytes_sent_ = 0;
  Transport* group_;
  Pipeline* pipeline_ = nullptr;
  int replica_ = 0;
  int replicas_ = 1;
  Duration timeout_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

/// `pipeline`'s replica_memory() with `optimizer`'s state bytes and its broadcasts (ZeRO-1) added: per rank, what
/// each ZeRO stage keeps and sends (twobp_bench zero reports it for zero 0, 1 and 2).
ReplicaMemory replica_memory(const Pipeline& pipeline, const ShardedOptimizer& optimizer);

}  // namespace twobp
