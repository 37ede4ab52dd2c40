#pragma once
// Data × pipeline parallelism (2D): dp replicas of a pp-rank pipeline, world = dp · pp ranks.
//
// Rank layout (one rule, here): world rank r is pipeline rank r % pp of replica r / pp. The pp stages of one
// replica are adjacent ranks, so with one rank per GPU and pp dividing the GPUs of a node, a replica's activations
// and input gradients (sent every micro-batch) stay inside a node, and only the data-parallel gradient reduction
// (once per step, overlapped with W) crosses nodes.
//
//   world rank:       0    1    2    3    4    5    6    7        dp = 2, pp = 4
//   replica:          0    0    0    0    1    1    1    1
//   pipeline rank:    0    1    2    3    0    1    2    3
//   pipeline group:   {0,1,2,3} {4,5,6,7}     data-parallel groups: {0,4} {1,5} {2,6} {3,7}
//
// A Pipeline runs on its pipeline group; PipelineOptions::data_parallel names the data-parallel group, and the
// pipeline then averages every parameter gradient over it (see DataParallelOptions) so that all replicas step
// with the gradient of the mean loss over the global batch.

#include <cstdint>
#include <memory>
#include <string>

#include "twobp/transport/transport.h"

namespace twobp {

/// Which replica and pipeline rank a world rank is (see the top of this file).
struct ParallelLayout {
  int dp = 1;  ///< replicas (data-parallel degree)
  int pp = 1;  ///< pipeline ranks per replica

  /// The layout of `world_size` ranks in `dp` replicas; UsageError unless dp >= 1 divides world_size.
  static ParallelLayout of(int world_size, int dp);

  int world_size() const { return dp * pp; }
  int replica(int world_rank) const { return world_rank / pp; }
  int pipeline_rank(int world_rank) const { return world_rank % pp; }
  int world_rank(int replica, int pipeline_rank) const { return replica * pp + pipeline_rank; }
};

/// The two groups of one rank, made from the world transport (collective: every rank constructs it, in the same
/// order with respect to the world's other collectives; it splits the world twice).
///
/// With dp == 1 nothing is split: pipeline() is the world itself and data_parallel() is null, so a
/// pipeline-only job pays nothing. Destroy the groups before the world transport.
///
/// The groups name their ranks' world ranks (Transport::world_rank_of) and report through the world's status
/// board: a stalled step gives one hang report over the whole job, by world rank, whichever group's wait timed out
/// (twobp/runtime/hang_report.h). A group split further from a group numbers its ranks within it.
class ParallelGroups {
 public:
  ParallelGroups(Transport& world, int dp, Duration timeout);
  ~ParallelGroups();
  ParallelGroups(const ParallelGroups&) = delete;
  ParallelGroups& operator=(const ParallelGroups&) = delete;

  const ParallelLayout& layout() const { return layout_; }
  int replica() const { return replica_; }
  int pipeline_rank() const { return pipeline_rank_; }
  /// The ranks of this replica, by pipeline rank: the transport to give the Pipeline.
  Transport& pipeline() { return pipeline_ ? *pipeline_ : world_; }
  /// The ranks holding the same stages in every replica, by replica; null when dp == 1.
  Transport* data_parallel() { return data_parallel_.get(); }

 private:
  Transport& world_;
  ParallelLayout layout_;
  int replica_ = 0;
  int pipeline_rank_ = 0;
  std::unique_ptr<Transport> pipeline_;
  std::unique_ptr<Transport> data_parallel_;
};

/// How much of the training state the data-parallel replicas shard (ZeRO, Rajbhandari et al.), chosen by
/// DataParallelOptions::zero. What each replica keeps of P trainable elements over dp replicas:
///   k0  nothing sharded: full gradients (all-reduced), full optimizer state, full masters.
///   k1  the optimizer state: ShardedOptimizer assigns whole parameters to replicas (gradients still all-reduced,
///       updated values broadcast by their owner). The Pipeline itself does as with k0.
///   k2  gradients and optimizer state: the Pipeline lays each stage's trainable parameters (their float32 masters
///       under mixed precision) out in flat buckets -- the reduction buckets -- and each replica owns the
///       contiguous shard_range(bucket, dp, replica) of every bucket. When a bucket's gradients are final (its
///       stage's last W, or last B in standard mode) it is reduce-scattered and the parameters' full .grad is
///       released; the replica keeps its shard of the averaged gradient. ShardedOptimizer(pipeline, ...) steps the
///       shards (AdamW is elementwise, so stepping a flat shard is exact) and all-gathers the updated values into
///       the working weights. Traffic: one reduce-scatter + one all-gather (= one all-reduce's bytes).
/// See docs/DATA_PARALLEL.md for when each stage pays, and ZeroStage's parse/to_string for the names "0", "1", "2".
enum class ZeroStage { k0 = 0, k1 = 1, k2 = 2 };

/// "0", "1", "2" (the --zero option's values and the JSON "zero" field).
const char* to_string(ZeroStage stage);
/// The inverse of to_string; UsageError naming the accepted values otherwise.
ZeroStage parse_zero_stage(const std::string& text);

/// The data-parallel collectives whose traffic the library counts (Pipeline::data_parallel_bytes_sent,
/// ShardedOptimizer::bytes_sent).
enum class CollectiveKind { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

/// Bytes one rank sends in a collective of a `bytes`-byte buffer over `world` ranks, by the ring algorithms (the
/// formula written once; nccl-tests' bus-bandwidth factors): all-reduce 2 (world-1)/world bytes, reduce-scatter and
/// all-gather (world-1)/world bytes, broadcast (world-1)/world bytes (a pipelined ring: every rank but the last
/// forwards the buffer; averaged over the ranks).
/// 0 for world <= 1. Rounded down to whole bytes.
std::int64_t collective_bytes_sent(CollectiveKind kind, std::int64_t bytes, int world);

/// Gradient averaging over the data-parallel group (PipelineOptions::data_parallel).
///
/// What: after every step, each parameter's .grad is the mean over the replicas of their .grad (each replica's
/// gradient being that of its own mean loss), i.e. the gradient of the mean loss over the global batch of
/// dp · num_micro_batches micro-batches. A gradient undefined on every replica stays undefined; one defined on
/// some replicas only (a parameter unused by some replicas' data) becomes defined everywhere, with zeros for the
/// replicas that had none, as one loss.backward() over the global batch would give. Sparse gradients are
/// refused (UsageError naming the stage): use a dense embedding with data parallelism. So is a buffer that changes
/// during a step (BatchNorm's running statistics): each replica would update it from its own share of the batch,
/// unlike one process on the global batch (UsageError after the first step, naming the stage and the buffer).
/// Only the chunks' parameters are averaged: a trainable tensor the forward uses without registering it keeps
/// its replica's own gradient (as with PyTorch DDP); register it to have it averaged.
///
/// When: each stage's parameters are reduced in buckets of about `bucket_bytes` (the first `first_bucket_bytes`;
/// one dtype per bucket, the
/// stage's parameters in reverse order of registration, as backward produces them), started asynchronously
/// as soon as all their parameters are final: during the stage's last weight-producing action of the step (its
/// last W in 2BP; its last B otherwise, which then runs as I and W back to back so that the fast-path layers
/// report their parameters as they finish, the role DDP's hooks play), the rest right after it, so that the
/// reduction overlaps the rank's remaining work and bubbles; a tensor shared by two chunks of a
/// rank is reduced once, after the later one. Pipeline::step() then waits for every bucket before it returns,
/// so the optimizer gate and the optimizer see reduced gradients; the time it waited is
/// StepResult::reduce_wait_us (the reduction time left exposed on the critical path).
///
/// With `overlap` false every bucket starts only after the rank's last action: the baseline the overlap is
/// measured against. On transports without asynchronous collectives (Local, Store:
/// Transport::asynchronous_all_reduce() false) overlap is off whatever the option says: a blocking reduction
/// started between two actions would couple the replicas' pipelines (and could deadlock them); reduce_wait_us
/// is then the whole reduction. Every replica must build the same model: the pipeline's
/// constructor checks that the replicas agree on each rank's parameters (one small all-reduce over the group).
struct DataParallelOptions {
  /// This rank's data-parallel group (ParallelGroups::data_parallel()); null or a group of one: no reduction.
  /// Must outlive the pipeline.
  Transport* group = nullptr;
  /// Target bucket size. Larger: fewer collectives (latency); smaller: the first bucket starts sooner.
  std::int64_t bucket_bytes = 25LL << 20;
  /// Size of each stage's first bucket (its last layers, the first final in W), as PyTorch DDP's 1 MB first
  /// bucket: a small bucket starts reducing while the rest of the W still runs.
  std::int64_t first_bucket_bytes = 1LL << 20;
  bool overlap = true;
  /// Standard mode with `overlap`: start a stage's buckets during its last B (run as I and W back to back, the
  /// role DDP's hooks play; the default) or, false, only once that B is over -- the weaker baseline, kept so that
  /// `twobp_bench pipeline --dp N` can report what the early start gains. No effect on 2BP (its W reports each
  /// layer as it finishes either way) or without `overlap`.
  bool start_during_backward = true;
  /// ZeroStage::k2 shards gradients (see ZeroStage): step with ShardedOptimizer(pipeline, factory), which then
  /// steps the replica's shards; after step() the parameters' .grad stay undefined (the averaged gradient exists
  /// only as shards: Pipeline::parameter_shards()). k0 and k1 change nothing in the Pipeline. Refused at
  /// construction together with PipelineOptions::tied_parameters, and by switch_schedule() (the flat layout
  /// follows the schedule's bucket order: build a new Pipeline and load a checkpoint).
  ZeroStage zero = ZeroStage::k0;
};

}  // namespace twobp
