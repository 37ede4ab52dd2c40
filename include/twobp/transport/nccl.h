#pragma once
// NcclTransport: CUDA tensors between processes, one rank per GPU. Built only when both NCCL and MPI were
// found: the NCCL unique ids are bootstrapped over MPI, and all_reduce_sum / barrier / abort go through MPI.

#include <utility>
#include <vector>

#include "twobp/config.h"
#include "twobp/transport/transport.h"

#if TWOBP_HAVE_NCCL && TWOBP_HAVE_MPI

#include <memory>

#include "twobp/transport/mpi.h"

namespace twobp {

/// The ordered (src, dst) links of a ring in both directions: every built-in schedule only talks to the
/// neighbouring stages. Deduplicated and sorted; empty for world_size 1.
std::vector<std::pair<int, int>> ring_links(int world_size);

struct NcclOptions {
  /// CUDA device of this rank; -1 = the node-local MPI rank (MpiEnvironment::local_rank()).
  int device = -1;
  /// Ordered (src, dst) links that may carry isend(src -> dst); empty = ring_links(world_size). Every rank
  /// must pass the same list (checked against rank 0's).
  std::vector<std::pair<int, int>> links;
  /// Bound on the collective construction (id broadcast and communicator setup).
  Duration init_timeout{120000};
};

/// Point-to-point transport over NCCL.
///
/// Design:
///  - One 2-rank communicator per ordered link (src is rank 0 in it), all created EAGERLY in the constructor in
///    one global deterministic order (sorted links) inside ncclGroupStart/End, with nonblocking
///    communicators so that setup is bounded by init_timeout. The constructor is collective over
///    MPI_COMM_WORLD.
///  - Each link has its own CUDA stream: a receive posted early on one link never blocks a send on another.
///  - isend/irecv: the link stream waits for an event recorded on the current compute stream (where the tensor
///    was produced), the transfer runs on the link stream (as bytes, so every dtype works), the caching
///    allocator is told the buffer is in use there (recordStream), and a done event is recorded.
///  - wait(timeout) polls the done event (and the communicator's async error) until done or the deadline, then
///    makes the current compute stream wait for the done event. On timeout the link's communicator is aborted
///    (ncclCommAbort): that link is unusable afterwards, further operations on it throw TransportError.
///  - NCCL transfers carry no header: shapes cannot be checked against the sender's. A mismatch is undefined
///    (typically a TimeoutError); check pipelines with LocalTransport or MpiTransport first.
///  - all_reduce_sum copies the tensor to the CPU and sums over MPI (it is meant for small tensors: losses,
///    norms; no world communicator is created). barrier is an MPI barrier; it does not synchronize the GPU.
///  - abort() aborts every NCCL communicator, then MPI_Abort: THE WHOLE JOB DIES.
///
/// Threading: use the transport from one thread. The constructor makes `device` the calling thread's
/// current CUDA device. A Work keeps the transport's communicators alive until it is destroyed.
class NcclTransport final : public Transport {
 public:
  NcclTransport(const MpiEnvironment& env, NcclOptions options = {});
  ~NcclTransport() override;

  int rank() const override;
  int world_size() const override;
  c10::Device device() const override;
  std::string name() const override { return "nccl"; }
  /// All links of the job (not only this rank's), sorted.
  const std::vector<std::pair<int, int>>& links() const;

  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  void all_reduce_sum(at::Tensor& tensor, Duration timeout) override;
  void barrier(Duration timeout) override;
  [[noreturn]] void abort(const std::string& reason) override;

  struct Impl;

 private:
  std::unique_ptr<Work> post(bool is_send, const at::Tensor& tensor, const P2POptions& options);

  std::shared_ptr<Impl> impl_;
};

}  // namespace twobp

#endif  // TWOBP_HAVE_NCCL && TWOBP_HAVE_MPI
