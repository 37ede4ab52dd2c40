#pragma once
// NcclTransport: CUDA tensors between processes, one rank per GPU. Built when NCCL was found. The NCCL unique
// ids are bootstrapped, and all_reduce_sum / barrier / abort run, over a host (CPU) transport: MpiTransport under
// mpirun, StoreTransport (a c10d::TCPStore) under torchrun or srun.

#include <memory>
#include <utility>
#include <vector>

#include "twobp/config.h"
#include "twobp/transport/transport.h"

#if TWOBP_HAVE_NCCL

#if TWOBP_HAVE_MPI
#include "twobp/transport/mpi.h"
#endif

namespace twobp {

/// The ordered (src, dst) links of a ring in both directions: every built-in schedule only talks to the
/// neighbouring stages. Deduplicated and sorted; empty for world_size 1.
std::vector<std::pair<int, int>> ring_links(int world_size);

struct NcclOptions {
  /// CUDA device of this rank; -1 = choose_cuda_device(local_rank, local_size, visible devices) (launch.h).
  int device = -1;
  /// This rank's position among the ranks of its node, for the default device. The MpiEnvironment constructor
  /// fills them in; with another host transport take them from LaunchEnv (launch.h).
  int local_rank = 0;
  int local_size = 1;
  /// Ordered (src, dst) links that may carry isend(src -> dst); empty = ring_links(world_size). Every rank
  /// must pass the same list (checked against rank 0's).
  std::vector<std::pair<int, int>> links;
  /// Channels per link (P2POptions::channel in [0, channels)): one communicator each. The default is enough for
  /// the pipeline to give each message kind its own communicator (message_channel in twobp/schedule/messages.h),
  /// which is what makes every built-in schedule pair correctly under NCCL's in-order rule.
  int channels = kDefaultChannelsPerLink;
  /// Create (and warm up) a communicator of every rank for all_reduce_sum_async (data-parallel gradient
  /// buckets) in the constructor. WHY at construction: created lazily, it would be set up in the middle of a
  /// step, while this rank's receives may occupy the GPU and the other ranks are busy elsewhere. Costs one
  /// communicator's memory per rank; false for a transport that never reduces buckets.
  bool collective = true;
  /// Bound on the collective construction (id broadcast, communicator setup and the warm-up exchanges).
  Duration init_timeout{120000};
  /// Stream-side receives (issue 70; default off until a GPU run measured both modes, docs/GPU.md): a receive's
  /// wait() does not poll on the host until the data arrived, it makes the current compute stream wait for the
  /// transfer (cudaStreamWaitEvent) and returns; a watchdog thread polls the transfer and, when it outlives the
  /// wait's timeout, aborts this rank's communicators (as ProcessGroupNCCL's watchdog does). The TimeoutError
  /// naming the wait is then raised by this transport's next call (any of them: a Pipeline's gradient check calls
  /// one every step). Sends and all_reduce_sum_async are waited on the host either way. NOT RUN ON A GPU YET.
  bool stream_waits = false;
};

/// Point-to-point transport over NCCL. Pairing: Pairing::kInOrderPerChannel (NCCL ignores tags).
///
/// Design:
///  - One 2-rank communicator per (link, channel) (src is rank 0 in it), all created EAGERLY in the constructor
///    in one global deterministic order inside ncclGroupStart/End, nonblocking so that setup is bounded by
///    init_timeout. The constructor is collective over the host transport.
///  - WARM-UP: NCCL connects a pair lazily on its first operation, and that needs the peer to post the
///    matching one. The constructor therefore exchanges one byte on every communicator, all in one group, so
///    every connection is made at start-up, while every rank is known to be in the constructor. Afterwards an
///    operation is handed to the GPU without waiting for the peer.
///  - Each communicator has its own CUDA stream: a receive posted early on one never blocks a send on another.
///  - isend/irecv never block the host on the peer: the channel stream waits for an event recorded on the
///    current compute stream (where the tensor was produced), the transfer is enqueued on the channel stream (as
///    bytes, so every dtype works), the caching allocator is told the buffer is in use there (recordStream), and
///    a done event is recorded. If NCCL reports the enqueue as still in progress (nonblocking communicators), the
///    done event is recorded once it settled -- by the Work's polls or by the next operation on the channel,
///    which waits for it at most P2POptions::timeout.
///  - wait(timeout) polls the done event (and the communicator's async error) until done or the deadline, then
///    makes the current compute stream wait for the done event. On timeout the channel's communicator is aborted
///    (ncclCommAbort): that channel is unusable afterwards, further operations on it throw TransportError.
///  - With NcclOptions::stream_waits a receive's wait(timeout) returns once the compute stream waits for the done
///    event (only the enqueue is settled on the host); a watchdog thread (src/transport/watchdog.h) polls the event
///    and the communicator's async error and, past the timeout, aborts every communicator of this transport and
///    records a TimeoutError naming the wait ("rank R: timed out after T ms waiting for RECV_F ... from rank P"),
///    which every later call (isend, irecv, wait, is_completed, the collectives, barrier, split) raises. A host
///    call that waits for the device (a loss's copy to the CPU) returns once the abort stopped the transfer;
///    data read from an aborted receive is garbage until that error is raised. The watchdog and the user thread
///    touch the communicators under one mutex. Not run on a GPU yet.
///  - status_board() is the host transport's (Store: through the TCPStore; MPI: where it has one), so a timed-out
///    wait gives the job-wide hang report as on the other transports.
///  - NCCL transfers carry no header: shapes cannot be checked against the sender's. A mismatch is undefined
///    (typically a TimeoutError); check pipelines with LocalTransport (in-order mode) or MpiTransport first.
///  - all_reduce_sum copies the tensor to the CPU and sums over the host transport (meant for small tensors:
///    losses, norms). all_reduce_sum_async (gradient buckets) stays on the GPU: a communicator of every rank with
///    a stream of its own, created and warmed up by the constructor (NcclOptions::collective), ncclAllReduce
///    waited like a receive (ran on one H200 with two processes: docs/GPU.md).
///  - reduce_scatter_sum / all_gather (and their async forms) on device tensors: ncclReduceScatter / ncclAllGather
///    (the bytes: any dtype) on that communicator and stream, in one sequence with all_reduce_sum_async. NCCL takes
///    the same count from every rank: when world_size does not divide n, each shard is padded to ceil(n / world)
///    in a buffer of the transport's (filled on the compute stream), and the result is copied out on the current
///    stream once the wait is over. Summation order is NCCL's. The first call of each compares every rank's n and
///    dtype over the host transport (one small all-reduce: UsageError on every rank when they differ); later calls
///    cannot be compared (a mismatch then hangs until the timeout or gives NCCL's error). CPU tensors go over the
///    host transport. NOT RUN ON A GPU YET.
///  - Errors: an NCCL failure carries NCCL's own last error text (ncclGetLastError); NCCL_DEBUG=WARN prints
///    NCCL's log. barrier is the host's; it does not synchronize the GPU.
///  - abort() aborts every NCCL communicator, then the host transport (under MPI: THE WHOLE JOB DIES).
///  - REQUIRES EAGER KERNEL LOADING (CUDA_MODULE_LOADING=EAGER in every rank's environment, before the process
///    first touches CUDA); the constructor raises UsageError under lazy loading (the default since CUDA 12.2).
///    WHY: a receive (or send) posted ahead is a kernel that spins until the peer's matching operation runs, and
///    under lazy loading the first launch of any other kernel (a first cuBLAS call, a new shape's GEMM, an
///    optimizer's kernel) waits for the GPU's queue to drain -- which that spinning kernel never does while the
///    peer waits the same way: both ranks hang inside cudaLaunchKernel. Seen on an H200 (docs/GPU.md; the ring test
///    of tests/transport/nccl_processes_test.cpp stuck in at::arange on both ranks, beside a pending receive).
///    Other host calls wait for the device the same way (loading a library's kernels, cudaFree): the constructor
///    creates the calling thread's cuBLAS and cuBLASLt handles before it posts anything, and a Pipeline never
///    posts a receive ahead of its rank's own earlier sends (receives_hold_device()), so each posted receive
///    completes without its rank doing anything more. Code that posts receives itself must keep that rule: a
///    receive that waits for one of our later sends, beside such a host call, hangs inside the driver.
///
/// Threading: use the transport from one thread. The constructor makes `device` the calling thread's
/// current CUDA device. A Work keeps the transport's communicators alive until it is destroyed.
class NcclTransport final : public Transport {
 public:
  /// `host`: a CPU transport over the same ranks (MpiTransport, StoreTransport); shared, kept alive.
  NcclTransport(std::shared_ptr<Transport> host, NcclOptions options = {});
#if TWOBP_HAVE_MPI
  /// Host transport: a new MpiTransport(env); local_rank/local_size from env.
  explicit NcclTransport(const MpiEnvironment& env, NcclOptions options = {});
#endif
  ~NcclTransport() override;

  int rank() const override;
  int world_size() const override;
  c10::Device device() const override;
  std::string name() const override { return "nccl"; }
  Pairing pairing() const override { return pairing_of("nccl"); }
  bool receives_hold_device() const override { return true; }  // ncclRecv is a kernel that spins
  /// The host transport's board (the store NCCL bootstrapped from, or MPI's).
  std::shared_ptr<StatusBoard> status_board() const override;
  /// All links of the job (not only this rank's), sorted.
  const std::vector<std::pair<int, int>>& links() const;

  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  void all_reduce_sum(at::Tensor& tensor, Duration timeout) override;
  /// On a communicator of every rank (created by the first call) and a stream of its own; see the class comment.
  std::unique_ptr<Work> all_reduce_sum_async(at::Tensor& tensor, Duration timeout) override;
  bool asynchronous_all_reduce() const override { return true; }
  void reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) override;
  std::unique_ptr<Work> reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                 Duration timeout) override;
  void all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) override;
  std::unique_ptr<Work> all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout) override;
  bool asynchronous_sharded_collectives() const override { return true; }
  void barrier(Duration timeout) override;
  /// Over the host transport on a CPU copy, like all_reduce_sum.
  void broadcast(at::Tensor& tensor, int root, Duration timeout) override;
  /// Splits the host transport, then builds a new NcclTransport over the group's host (own communicators per
  /// link and channel of the group's ring, on this rank's GPU, set up within `timeout`). UNTESTED on GPUs.
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override;
  void abort(const std::string& reason) override;

  struct Impl;

 private:
  std::unique_ptr<Work> post(bool is_send, const at::Tensor& tensor, const P2POptions& options);

  std::shared_ptr<Impl> impl_;
};

}  // namespace twobp

#endif  // TWOBP_HAVE_NCCL
