#pragma once
// Point-to-point tensor transport between pipeline ranks. One interface, several implementations:
// LocalTransport (ranks are threads of one process), MpiTransport (CPU tensors between processes) and
// NcclTransport (CUDA tensors, one rank per GPU). The executor never knows which one it talks to.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "twobp/transport/pairing.h"

namespace twobp {

class StatusBoard;  // twobp/transport/status_board.h

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::milliseconds;

/// Handle of an asynchronous send or receive.
///
/// Contract: wait() blocks until the operation completed (a received tensor is then valid for use on the
/// current CUDA stream, for GPU transports) or the timeout elapsed, in which case it throws TimeoutError naming
/// the peer and the operation's label. A transport failure or an abort raised by another rank throws
/// TransportError. wait() may be called at most once; destroying an unfinished Work of a send is allowed only
/// after the transport was aborted.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait(Duration timeout) = 0;
  /// Non-blocking probe; throws like wait() if the operation failed.
  virtual bool is_completed() = 0;
};

/// Describes one point-to-point operation. `tag` must be unique among the operations in flight between the
/// same pair of ranks; `label` ("SEND_F stage 1 micro-batch 3") is used in every error about the operation.
/// `channel` selects the ordered stream of messages an in-order transport (Pairing::kInOrderPerChannel) pairs
/// within; by-tag transports ignore it. The Pipeline sets it from message_channel(). `timeout` bounds any wait
/// inside isend/irecv themselves (an in-order transport may have to wait until the previous operation on the
/// channel was handed to the device); it never waits for the peer there.
struct P2POptions {
  int peer = 0;
  std::int64_t tag = 0;
  std::string label;
  int channel = 0;
  Duration timeout = std::chrono::minutes(5);
};

/// [begin, end): a contiguous range of a flat buffer's elements.
struct ShardRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const ShardRange& o) const { return begin == o.begin && end == o.end; }
  bool operator!=(const ShardRange& o) const { return !(*this == o); }
};

/// The shard of `rank` among `world` ranks of a flat buffer of `n` elements: THE layout of reduce_scatter_sum and
/// all_gather (and of state sharded to match them). Contiguous, in rank order, sizes differing by at most one: with
/// q = n / world and m = n % world, ranks 0 .. m-1 hold q + 1 elements and the others q (numpy.array_split's and
/// torch.tensor_split's rule), i.e. rank r holds [r q + min(r, m), (r + 1) q + min(r + 1, m)). With n < world,
/// ranks n .. world-1 hold empty shards. UsageError for n < 0, world < 1 or rank outside [0, world).
ShardRange shard_range(std::int64_t n, int world, int rank);

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Device tensors live on (CPU for Local/MPI, the rank's GPU for NCCL).
  virtual c10::Device device() const = 0;
  virtual std::string name() const = 0;
  /// The job-wide rank of this group's rank `group_rank`, as hang reports name ranks. A transport that is no group
  /// of a larger one answers `group_rank`; the groups of ParallelGroups (twobp/runtime/data_parallel.h) answer
  /// their world's ranks.
  virtual int world_rank_of(int group_rank) const { return group_rank; }
  /// How this transport pairs a receive with a send (see Pairing). A Pipeline refuses, before its first step, a
  /// schedule that this rule cannot pair (validate(schedule, pairing())).
  virtual Pairing pairing() const = 0;
  /// Whether other ranks of this job run as threads of this process (the Local transport): they then share its
  /// process-wide state -- LibTorch's default random generators above all -- and a Pipeline refuses what would
  /// make their results depend on how the threads interleave (twobp/random.h).
  virtual bool ranks_share_process() const { return false; }
  /// How many ranks of this process compute on device() (this one included). Above 1, the device's process-wide
  /// counters -- the caching allocator's statistics, a GPU's energy meter -- are every such rank's at once: memory
  /// recording on such a device is refused, and energy is divided among them. Ranks in other processes are not
  /// counted (a process has allocator statistics of its own; their energy readings are not divided).
  virtual int ranks_sharing_device() const { return 1; }
  /// Whether a posted receive holds the device until its data arrives (NCCL: the receive is a kernel that spins).
  /// Host calls that wait for the device to go idle -- loading a kernel module, cudaFree -- then wait for the
  /// receive, so a receive whose data needs one of this rank's later sends deadlocks beside them, inside the
  /// driver, where no timeout reaches. A Pipeline on such a transport therefore never posts a receive ahead of its
  /// rank's own earlier sends (ExecutorOptions::prefetch_receives).
  virtual bool receives_hold_device() const { return false; }
  /// Where this group's ranks tell each other what they are doing when a step stalls, for the hang report
  /// (twobp/runtime/hang_report.h). Local: in-process; Store: through the store; MPI: over a communicator of its
  /// own (with MPI_THREAD_MULTIPLE); NCCL: its host transport's; null for transports that have none, whose ranks
  /// then report only their own wait.
  virtual std::shared_ptr<StatusBoard> status_board() const { return nullptr; }

  /// Sends `tensor` (contiguous) to options.peer. The tensor must not be modified until wait() returned.
  virtual std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) = 0;

  /// Receives into `buffer`, which must be contiguous and have exactly the shape and dtype of what the peer
  /// sends; a mismatch is reported by wait() as UsageError naming both ranks (where the transport can tell).
  virtual std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) = 0;

  /// Sums `tensor` element-wise across all ranks in place. Any size and dtype the transport can add (losses and
  /// norms as well as whole gradient buckets), on device() -- or on the CPU, which every transport accepts (host
  /// values such as losses and norms need no device round trip). Every rank must call it in the same order, with the
  /// same shape and dtype. Blocks at most `timeout`. Reduction order: each implementation documents it (Local and
  /// Store sum in rank order and are bitwise reproducible; MPI leaves the order to the MPI library).
  virtual void all_reduce_sum(at::Tensor& tensor, Duration timeout) = 0;

  /// all_reduce_sum() without waiting: starts the reduction and returns its handle; `tensor` holds the sum once
  /// wait() returned and must not be read or written before. The same collective ordering rules apply: every
  /// rank starts the same reductions in the same order (with respect to all collectives of this transport).
  /// Used for data-parallel gradient buckets, so that reductions overlap the rest of a step.
  /// MPI: MPI_Iallreduce, progressed while other MPI traffic runs. NCCL: a collective communicator of its own,
  /// on its own stream. The default (Local, Store): reduces at once, blocking up to `timeout`, and returns a
  /// completed handle -- correct, but nothing overlaps.
  virtual std::unique_ptr<Work> all_reduce_sum_async(at::Tensor& tensor, Duration timeout);
  /// Whether all_reduce_sum_async returns before the reduction is done (MPI, NCCL), i.e. can overlap compute.
  virtual bool asynchronous_all_reduce() const { return false; }

  /// Reduce-scatter (ZeRO-2's gradient sharding): `input`, n elements on every rank, and `output`, which receives
  /// the element-wise sum over the ranks of this rank's shard of their inputs (shard_range(n, world_size(), rank())).
  /// Both flat (1-D) and contiguous, of one dtype, on device() or the CPU (as all_reduce_sum); every rank passes the
  /// same n and dtype. Collective, in the same order as the others; blocks at most `timeout` (TimeoutError naming
  /// the ranks it waited for, where the transport can tell). Dtypes and reduction order are all_reduce_sum's (each
  /// transport documents them; on Local and Store reduce_scatter_sum then all_gather gives all_reduce_sum's result
  /// bitwise). UsageError naming the rank and what was expected for a tensor of the wrong size, dtype, device, rank
  /// or layout, and for ranks that disagree on n or dtype: on every call on Local and Store, on the first call of
  /// each of reduce_scatter_sum / all_gather on MPI and NCCL (one small all-reduce of what every rank passes; their
  /// later calls are not compared across ranks: a rank passing another n then gets MPI's or NCCL's own error, a
  /// timeout or a wrong result).
  ///
  /// The transport records no wait of its own: a caller beside a Pipeline runs it through Pipeline::run_collective,
  /// so that a stall names it, and the ranks that did not join it, in the job-wide hang report.
  ///
  /// The default, for Transport subclasses written against 0.2 (every built-in transport overrides it): a copy of
  /// `input` summed by all_reduce_sum, then this rank's shard of it -- correct, but with all-reduce's traffic.
  virtual void reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout);
  /// reduce_scatter_sum() without waiting, as all_reduce_sum_async: `output` holds the shard once wait() returned;
  /// neither tensor may be used before (input not written, output not read or written). The default runs the
  /// blocking form and returns a completed handle; asynchronous_sharded_collectives() says which transports overlap.
  virtual std::unique_ptr<Work> reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                         Duration timeout);

  /// All-gather, reduce_scatter_sum's inverse layout: `shard` is this rank's part, shard_range(n, world_size(),
  /// rank()), of the n-element `output`, which every rank receives whole. Any dtype (the bytes are moved); tensors,
  /// errors, ordering and timeout as reduce_scatter_sum. The default, for Transport subclasses written against 0.2:
  /// one broadcast per rank of its shard into `output`, in rank order within one deadline -- exact for every dtype,
  /// all-gather's traffic, world_size() collectives' latency.
  virtual void all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout);
  /// all_gather() without waiting: `output` holds every shard once wait() returned; rules and default as
  /// reduce_scatter_sum_async.
  virtual std::unique_ptr<Work> all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout);
  /// Whether reduce_scatter_sum_async and all_gather_async return before the collective is done (MPI, NCCL), i.e.
  /// can overlap compute; false for the defaults.
  virtual bool asynchronous_sharded_collectives() const { return false; }

  /// Overwrites `tensor` on every rank with the tensor of rank `root`. Collective: every rank calls it in the
  /// same order with respect to the other collectives, with the same shape, dtype and root. Blocks at most
  /// `timeout` (TimeoutError naming the ranks it waited for, where the transport can tell).
  virtual void broadcast(at::Tensor& tensor, int root, Duration timeout) = 0;

  /// Splits this transport into groups, like MPI_Comm_split / c10d new_group: a data-parallel group and a
  /// pipeline group can coexist. Collective over all ranks of this transport: every rank calls it, in the same
  /// order with respect to the other collectives (it is one of them). Ranks passing the same `color` form one
  /// new transport whose ranks are ordered by (key, rank here); `color` < 0 means "in no group": that rank gets
  /// nullptr (it must still call split). The child's rank()/world_size() are group-local; its errors name the
  /// group rank, the parent's rank and the color. Messages of different groups (and of the parent) never match
  /// each other. Blocks at most `timeout`: a rank that never calls split makes the others throw TimeoutError.
  ///
  /// NB: a child may share state with its parent (Local: the parent's shared state hands out the group; MPI: the
  /// communicator is derived from the parent's): destroy children before their parent.
  virtual std::unique_ptr<Transport> split(int color, int key, Duration timeout) = 0;

  /// Blocks until every rank reached the barrier, or throws TimeoutError.
  virtual void barrier(Duration timeout) = 0;

  /// Tells every peer that this rank failed with `reason`, so their pending and future waits throw
  /// TransportError naming this rank instead of waiting for their timeout. Under MPI this aborts the job.
  virtual void abort(const std::string& reason) = 0;
};

}  // namespace twobp
