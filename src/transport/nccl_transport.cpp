// NcclTransport: see twobp/transport/nccl.h for the design. Every CUDA and NCCL call is checked
// (TWOBP_CUDA_CHECK / TWOBP_NCCL_CHECK); every wait polls with a deadline.

#include "twobp/config.h"

#if TWOBP_HAVE_NCCL && TWOBP_HAVE_MPI

#include "twobp/transport/nccl.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "transport/common.h"
#include "transport/mpi_check.h"
#include "util/check.h"

#define TWOBP_CUDA_CHECK(call)                                                                             \
  do {                                                                                                     \
    const cudaError_t twobp_cuda_rc_ = (call);                                                             \
    if (twobp_cuda_rc_ != cudaSuccess) {                                                                   \
      ::twobp::detail::raise<::twobp::TransportError>("{} failed at {}:{}: {}", #call, __FILE__, __LINE__, \
                                                      cudaGetErrorString(twobp_cuda_rc_));                 \
    }                                                                                                      \
  } while (false)

/// ncclInProgress is not an error: the communicators are nonblocking (see Impl::settle).
#define TWOBP_NCCL_CHECK(call)                                                                                 \
  do {                                                                                                         \
    const ncclResult_t twobp_nccl_rc_ = (call);                                                                \
    if (twobp_nccl_rc_ != ncclSuccess && twobp_nccl_rc_ != ncclInProgress) {                                   \
      ::twobp::detail::raise<::twobp::TransportError>("{} failed at {}:{}: {} ({})", #call, __FILE__, __LINE__, \
                                                      ncclGetErrorString(twobp_nccl_rc_),                     \
                                                      ncclGetLastError(nullptr));                              \
    }                                                                                                          \
  } while (false)

namespace twobp {

std::vector<std::pair<int, int>> ring_links(int world_size) {
  std::vector<std::pair<int, int>> links;
  if (world_size < 2) return links;
  for (int r = 0; r < world_size; ++r) {
    const int next = (r + 1) % world_size;
    links.emplace_back(r, next);
    links.emplace_back(next, r);
  }
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());
  return links;
}

namespace detail {
namespace {

struct Link {
  int src = 0;
  int dst = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool broken = false;  // aborted after a timeout or an asynchronous NCCL error
};

/// Polls a nonblocking MPI request (the bootstrap broadcasts) with a deadline.
void mpi_poll(MPI_Request& request, Clock::time_point deadline, int rank, const char* what, Duration timeout) {
  Backoff backoff;
  for (;;) {
    int flag = 0;
    TWOBP_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE));
    if (flag) return;
    if (Clock::now() >= deadline) {
      // A nonblocking collective can be neither cancelled nor freed: the request and its buffer are leaked.
      raise<TimeoutError>("rank {}: NcclTransport setup timed out after {} ms in {} (did every rank construct "
                          "an NcclTransport?)",
                          rank, timeout.count(), what);
    }
    backoff.pause();
  }
}

}  // namespace
}  // namespace detail

struct NcclTransport::Impl {
  int rank = 0;
  int world = 1;
  int device = 0;
  std::unique_ptr<MpiTransport> mpi;  // all_reduce_sum, barrier, abort
  std::vector<std::pair<int, int>> all_links;
  std::map<std::pair<int, int>, detail::Link> links;  // the links this rank is an end of

  ~Impl() {
    // Destructors must not throw and must not hang: finalize politely with a deadline, abort otherwise.
    for (auto& [key, link] : links) {
      if (link.comm != nullptr) {
        bool clean = false;
        if (!link.broken) {
          const ncclResult_t rc = ncclCommFinalize(link.comm);  // flushes pending operations
          clean = rc == ncclSuccess || rc == ncclInProgress;
        }
        const auto deadline = Clock::now() + Duration(10000);
        detail::Backoff backoff;
        ncclResult_t state = ncclInProgress;
        while (clean) {
          if (ncclCommGetAsyncError(link.comm, &state) != ncclSuccess || state != ncclInProgress) break;
          if (Clock::now() >= deadline) {
            clean = false;
            break;
          }
          backoff.pause();
        }
        if (clean && state == ncclSuccess) {
          ncclCommDestroy(link.comm);
        } else {
          ncclCommAbort(link.comm);
        }
        link.comm = nullptr;
      }
      if (link.stream != nullptr) cudaStreamDestroy(link.stream);
    }
  }

  detail::Link& link(int src, int dst, const char* what, const P2POptions& options) {
    auto it = links.find({src, dst});
    TWOBP_CHECK(it != links.end(), UsageError,
                "rank {}: {} {}: there is no NCCL link {} -> {}; list it in NcclOptions::links (the same list on "
                "every rank)",
                rank, what, detail::describe_op(options), src, dst);
    TWOBP_CHECK(!it->second.broken, TransportError,
                "rank {}: {} {}: the NCCL link {} -> {} was aborted after an earlier timeout or error", rank, what,
                detail::describe_op(options), src, dst);
    return it->second;
  }

  /// Nonblocking communicators may answer ncclInProgress while an operation is being enqueued; NCCL requires
  /// that state to settle before the next call on the communicator.
  void settle(detail::Link& l, Duration timeout, const std::string& what) {
    const auto deadline = detail::deadline_after(timeout);
    detail::Backoff backoff;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      TWOBP_NCCL_CHECK(ncclCommGetAsyncError(l.comm, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        ncclCommAbort(l.comm);
        l.comm = nullptr;
        l.broken = true;
        detail::raise<TransportError>("rank {}: {}: NCCL link {} -> {} failed: {}", rank, what, l.src, l.dst,
                                      ncclGetErrorString(state));
      }
      if (Clock::now() >= deadline) {
        ncclCommAbort(l.comm);
        l.comm = nullptr;
        l.broken = true;
        detail::raise<TimeoutError>("rank {}: {}: NCCL link {} -> {} did not become ready within {} ms", rank,
                                    what, l.src, l.dst, timeout.count());
      }
      backoff.pause();
    }
  }
};

namespace detail {
namespace {

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclTransport::Impl> impl, Link* link, bool is_send, P2POptions options)
      : impl_(std::move(impl)), link_(link), is_send_(is_send), options_(std::move(options)) {
    TWOBP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    TWOBP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }

  ~NcclWork() override {
    // Destroying a recorded, unfinished event is allowed; the buffers are protected by recordStream.
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (done_ != nullptr) cudaEventDestroy(done_);
  }

  cudaEvent_t ready() const { return ready_; }
  cudaEvent_t done() const { return done_; }

  void wait(Duration timeout) override {
    if (finished_) return;
    const auto deadline = deadline_after(timeout);
    Backoff backoff;
    while (!poll()) {
      if (Clock::now() >= deadline) {
        // The peer never posted the matching operation (or died): abort this link's communicator so that
        // its kernel stops occupying the link stream and the GPU; the link is unusable afterwards.
        if (link_->comm != nullptr) ncclCommAbort(link_->comm);
        link_->comm = nullptr;
        link_->broken = true;
        raise<TimeoutError>("rank {}: timed out after {} ms waiting for {} {} rank {}", impl_->rank,
                            timeout.count(), describe_op(options_), is_send_ ? "to" : "from", options_.peer);
      }
      backoff.pause();
    }
    finish();
  }

  bool is_completed() override {
    if (finished_) return true;
    if (!poll()) return false;
    finish();
    return true;
  }

 private:
  std::string what() const {
    return fmt::format("{} {} rank {}", describe_op(options_), is_send_ ? "to" : "from", options_.peer);
  }

  bool poll() {
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) {
      raise<TransportError>("rank {}: {}: cudaEventQuery failed: {}", impl_->rank, what(), cudaGetErrorString(q));
    }
    TWOBP_CHECK(!link_->broken && link_->comm != nullptr, TransportError,
                "rank {}: {}: the NCCL link {} -> {} was aborted", impl_->rank, what(), link_->src, link_->dst);
    // A dead peer or network failure shows up as an asynchronous communicator error, not as a CUDA error.
    ncclResult_t state = ncclSuccess;
    TWOBP_NCCL_CHECK(ncclCommGetAsyncError(link_->comm, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      ncclCommAbort(link_->comm);
      link_->comm = nullptr;
      link_->broken = true;
      raise<TransportError>("rank {}: {}: NCCL link {} -> {} failed: {}", impl_->rank, what(), link_->src,
                            link_->dst, ncclGetErrorString(state));
    }
    return false;
  }

  void finish() {
    finished_ = true;
    c10::cuda::CUDAGuard guard(impl_->device);
    // SYNC POINT (consumer side): the caller continues on its current compute stream, which may differ from
    // the one current at isend/irecv. Ordering it after the done event makes a received tensor safe to read
    // and a sent one safe to overwrite on that stream. (The event has completed, so this costs nothing; it
    // keeps the contract independent of the host-side polling above.)
    TWOBP_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(impl_->device).stream(), done_, 0));
  }

  std::shared_ptr<NcclTransport::Impl> impl_;
  Link* link_;  // owned by impl_->links (a std::map: stable address)
  bool is_send_;
  P2POptions options_;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  bool finished_ = false;
};

}  // namespace
}  // namespace detail

NcclTransport::NcclTransport(const MpiEnvironment& env, NcclOptions options) : impl_(std::make_shared<Impl>()) {
  auto& im = *impl_;
  im.rank = env.rank();
  im.world = env.world_size();
  im.mpi = std::make_unique<MpiTransport>(env);
  const auto deadline = detail::deadline_after(options.init_timeout);

  int count = 0;
  TWOBP_CUDA_CHECK(cudaGetDeviceCount(&count));
  im.device = options.device >= 0 ? options.device : env.local_rank();
  TWOBP_CHECK(im.device < count, UsageError,
              "rank {}: NcclTransport: CUDA device {} does not exist ({} visible; local rank {}): run at most one "
              "rank per GPU",
              im.rank, im.device, count, env.local_rank());
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(im.device));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(im.device));

  im.all_links = options.links.empty() ? ring_links(im.world) : options.links;
  for (const auto& [src, dst] : im.all_links) {
    TWOBP_CHECK(src >= 0 && src < im.world && dst >= 0 && dst < im.world && src != dst, UsageError,
                "rank {}: NcclOptions::links: invalid link {} -> {} (world size {})", im.rank, src, dst, im.world);
  }
  std::sort(im.all_links.begin(), im.all_links.end());
  im.all_links.erase(std::unique(im.all_links.begin(), im.all_links.end()), im.all_links.end());

  // Bootstrap over a private MPI communicator: rank 0 creates one NCCL unique id per link and broadcasts them
  // together with its link list, which every rank compares with its own.
  MPI_Comm boot = MPI_COMM_NULL;
  TWOBP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &boot));
  struct CommFree {
    MPI_Comm* c;
    ~CommFree() { MPI_Comm_free(c); }
  } free_boot{&boot};
  TWOBP_MPI_CHECK(MPI_Comm_set_errhandler(boot, MPI_ERRORS_RETURN));
  // WHY heap buffers deleted only on success: after a timeout the broadcast may still complete later and
  // write into them, so they are leaked then rather than freed under MPI.
  auto* count_buf = new std::int64_t(static_cast<std::int64_t>(im.all_links.size()));
  MPI_Request request = MPI_REQUEST_NULL;
  TWOBP_MPI_CHECK(MPI_Ibcast(count_buf, 1, MPI_INT64_T, 0, boot, &request));
  detail::mpi_poll(request, deadline, im.rank, "broadcasting the link count", options.init_timeout);
  const std::int64_t n_links = *count_buf;
  delete count_buf;
  constexpr std::size_t kPerLink = 2 * sizeof(std::int32_t) + sizeof(ncclUniqueId);
  auto* blob = new std::vector<char>(static_cast<std::size_t>(n_links) * kPerLink);
  if (im.rank == 0) {
    for (std::size_t k = 0; k < im.all_links.size(); ++k) {
      char* p = blob->data() + k * kPerLink;
      const std::int32_t ends[2] = {im.all_links[k].first, im.all_links[k].second};
      std::memcpy(p, ends, sizeof(ends));
      ncclUniqueId id;
      TWOBP_NCCL_CHECK(ncclGetUniqueId(&id));
      std::memcpy(p + sizeof(ends), &id, sizeof(id));
    }
  }
  TWOBP_MPI_CHECK(MPI_Ibcast(blob->data(), static_cast<int>(blob->size()), MPI_BYTE, 0, boot, &request));
  detail::mpi_poll(request, deadline, im.rank, "broadcasting the NCCL ids", options.init_timeout);
  std::vector<std::pair<int, int>> root_links(static_cast<std::size_t>(n_links));
  std::vector<ncclUniqueId> ids(static_cast<std::size_t>(n_links));
  for (std::int64_t k = 0; k < n_links; ++k) {
    const char* p = blob->data() + k * kPerLink;
    std::int32_t ends[2];
    std::memcpy(ends, p, sizeof(ends));
    root_links[k] = {ends[0], ends[1]};
    std::memcpy(&ids[k], p + sizeof(ends), sizeof(ncclUniqueId));
  }
  delete blob;
  // Disagreeing ranks would wait for each other's communicators until the timeout: say what differs instead.
  // (All ranks see rank 0's list, so all of them raise.)
  TWOBP_CHECK(root_links == im.all_links, UsageError,
              "rank {}: NcclOptions::links differ from rank 0's ({} links here, {} on rank 0): every rank must "
              "pass the same list",
              im.rank, im.all_links.size(), root_links.size());

  // Eager creation in one global order. WHY a group: one thread creates several communicators whose peers
  // create theirs in the same global order; grouped, NCCL connects them together instead of deadlocking on
  // the first one. WHY nonblocking: so a missing peer makes us time out instead of hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  auto create_links = [&] {
    TWOBP_NCCL_CHECK(ncclGroupStart());
    for (std::size_t k = 0; k < im.all_links.size(); ++k) {
      const auto [src, dst] = im.all_links[k];
      if (src != im.rank && dst != im.rank) continue;
      detail::Link& l = im.links[{src, dst}];
      l.src = src;
      l.dst = dst;
      TWOBP_NCCL_CHECK(ncclCommInitRankConfig(&l.comm, 2, ids[k], src == im.rank ? 0 : 1, &config));
    }
    TWOBP_NCCL_CHECK(ncclGroupEnd());
    for (auto& [key, l] : im.links) {
      im.settle(l, std::max(Duration(0), std::chrono::duration_cast<Duration>(deadline - Clock::now())),
                fmt::format("creating the communicator of link {} -> {}", l.src, l.dst));
      // A stream of its own per link; non-blocking w.r.t. the legacy default stream.
      TWOBP_CUDA_CHECK(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking));
    }
  };
  try {
    create_links();
  } catch (...) {
    // A half-created set of communicators cannot be finalized politely: abort them all.
    for (auto& [key, l] : im.links) {
      if (l.comm != nullptr) ncclCommAbort(l.comm);
      l.comm = nullptr;
      l.broken = true;
    }
    throw;
  }
}

NcclTransport::~NcclTransport() = default;

int NcclTransport::rank() const { return impl_->rank; }
int NcclTransport::world_size() const { return impl_->world; }
c10::Device NcclTransport::device() const {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(impl_->device));
}
const std::vector<std::pair<int, int>>& NcclTransport::links() const { return impl_->all_links; }

std::unique_ptr<Work> NcclTransport::isend(const at::Tensor& tensor, const P2POptions& options) {
  return post(true, tensor, options);
}

std::unique_ptr<Work> NcclTransport::irecv(at::Tensor& buffer, const P2POptions& options) {
  return post(false, buffer, options);
}

std::unique_ptr<Work> NcclTransport::post(bool is_send, const at::Tensor& tensor, const P2POptions& options) {
  auto& im = *impl_;
  const char* what = is_send ? "isend" : "irecv";
  detail::check_p2p_args(what, im.rank, im.world, tensor, options);
  TWOBP_CHECK(tensor.is_cuda() && tensor.device().index() == im.device, UsageError,
              "rank {}: {} {}: NcclTransport moves tensors on cuda:{}, got one on {}", im.rank, what,
              detail::describe_op(options), im.device, tensor.device().str());
  detail::Link& link = is_send ? im.link(im.rank, options.peer, what, options)
                               : im.link(options.peer, im.rank, what, options);
  const int peer_in_link = link.src == im.rank ? 1 : 0;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(im.device));
  const auto compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(im.device));
  auto work = std::make_unique<detail::NcclWork>(impl_, &link, is_send, options);

  // SYNC POINT (producer side): the tensor was produced -- for a receive buffer: last used -- by work queued on
  // the compute stream. The link stream must not read (send) or overwrite (receive) it before that finished.
  TWOBP_CUDA_CHECK(cudaEventRecord(work->ready(), compute.stream()));
  TWOBP_CUDA_CHECK(cudaStreamWaitEvent(link.stream, work->ready(), 0));
  const std::size_t bytes = tensor.nbytes();
  if (bytes > 0) {  // both ends agree on the size, so both skip an empty transfer
    // Bytes, not elements: every dtype (fp8, complex, bool) travels the same way.
    if (is_send) {
      TWOBP_NCCL_CHECK(ncclSend(tensor.data_ptr(), bytes, ncclUint8, peer_in_link, link.comm, link.stream));
    } else {
      TWOBP_NCCL_CHECK(ncclRecv(tensor.data_ptr(), bytes, ncclUint8, peer_in_link, link.comm, link.stream));
    }
    im.settle(link, Duration(60000), fmt::format("{} {}", what, detail::describe_op(options)));
    // SYNC POINT (memory lifetime): the caching allocator would give this memory to a new tensor as soon as the
    // caller drops its reference, although the link stream may still be using it. recordStream delays reuse
    // until the work queued so far on the link stream is done.
    c10::cuda::CUDACachingAllocator::recordStream(
        tensor.storage().data_ptr(),
        c10::cuda::getStreamFromExternal(link.stream, static_cast<c10::DeviceIndex>(im.device)));
  }
  TWOBP_CUDA_CHECK(cudaEventRecord(work->done(), link.stream));
  return work;
}

void NcclTransport::all_reduce_sum(at::Tensor& tensor, Duration timeout) {
  TWOBP_CHECK(tensor.defined(), UsageError, "rank {}: all_reduce_sum of an undefined tensor", impl_->rank);
  // WHY over MPI on a CPU copy: this is for a handful of scalars (loss, gradient norm). The device-to-host
  // copy synchronizes with the compute stream that produced the values; a world NCCL communicator would cost
  // memory and setup time on every rank for no measurable gain.
  at::Tensor cpu = tensor.to(c10::kCPU).contiguous();
  impl_->mpi->all_reduce_sum(cpu, timeout);
  tensor.copy_(cpu);
}

void NcclTransport::barrier(Duration timeout) { impl_->mpi->barrier(timeout); }

void NcclTransport::abort(const std::string& reason) {
  // Abort the communicators first: MPI_Abort may take a moment to kill us, and the peers' NCCL kernels should
  // not wait on ours meanwhile.
  for (auto& [key, link] : impl_->links) {
    if (link.comm != nullptr) ncclCommAbort(link.comm);
    link.comm = nullptr;
    link.broken = true;
  }
  impl_->mpi->abort(reason);
}

}  // namespace twobp

#endif  // TWOBP_HAVE_NCCL && TWOBP_HAVE_MPI
