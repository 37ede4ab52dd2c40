// NcclTransport: see twobp/transport/nccl.h for the design. Every CUDA and NCCL call is checked
// (TWOBP_CUDA_CHECK / TWOBP_NCCL_CHECK); every wait polls with a deadline.

#include "twobp/config.h"

#if TWOBP_HAVE_NCCL

#include "twobp/transport/nccl.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>  // types only: the driver's entry point is fetched through the runtime, libcuda is not linked
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "transport/common.h"
#include "transport/watchdog.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/status_board.h"
#include "util/check.h"

#if TWOBP_HAVE_MPI
#include "twobp/transport/mpi.h"
#endif

#define TWOBP_CUDA_CHECK(call)                                                                             \
  do {                                                                                                     \
    const cudaError_t twobp_cuda_rc_ = (call);                                                             \
    if (twobp_cuda_rc_ != cudaSuccess) {                                                                   \
      ::twobp::detail::raise<::twobp::TransportError>("{} failed at {}:{}: {}", #call, __FILE__, __LINE__, \
                                                      cudaGetErrorString(twobp_cuda_rc_));                 \
    }                                                                                                      \
  } while (false)

/// ncclInProgress is not an error: the communicators are nonblocking (see Channel::settled).
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

/// The done event of an operation whose enqueue NCCL reported as in progress: it is recorded on the channel
/// stream once the communicator settled (the kernel is queued by then). Shared by the Work, the channel and --
/// for a stream-side wait -- the watchdog, which may poll it after the Work is gone: the last owner destroys it.
struct PendingDone {
  cudaEvent_t done = nullptr;
  bool recorded = false;
  PendingDone() = default;
  PendingDone(const PendingDone&) = delete;
  PendingDone& operator=(const PendingDone&) = delete;
  ~PendingDone() {
    if (done != nullptr) cudaEventDestroy(done);
  }
};

/// One communicator: (src -> dst, channel). src is rank 0 in it.
struct Channel {
  int src = 0;
  int dst = 0;
  int channel = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool broken = false;  // aborted after a timeout or an asynchronous NCCL error
  std::shared_ptr<PendingDone> unsettled;  // the last operation, while NCCL still enqueues it

  std::string name() const { return fmt::format("NCCL channel {} of link {} -> {}", channel, src, dst); }

  void abort_comm() {
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
    broken = true;
  }

  /// Polls the communicator once. Returns true when it has no operation in progress (recording the done event
  /// of an operation that was in progress); false while NCCL is still working; throws on an NCCL error (after
  /// aborting the communicator).
  bool settled(int rank, const std::string& what) {
    TWOBP_CHECK(!broken && comm != nullptr, TransportError, "rank {}: {}: the {} was aborted earlier", rank, what,
                name());
    ncclResult_t state = ncclSuccess;
    TWOBP_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclInProgress) return false;
    if (state != ncclSuccess) {
      // NCCL's own sentence ("Duplicate GPU detected", "socket connect failed ...") says far more than the code;
      // read it before the abort frees the communicator.
      const std::string detail = ncclGetLastError(comm);
      abort_comm();
      raise<TransportError>("rank {}: {}: {} failed: {}{}{} (NCCL_DEBUG=WARN prints NCCL's log)", rank, what,
                            name(), ncclGetErrorString(state), detail.empty() ? "" : ": ", detail);
    }
    if (unsettled) {
      TWOBP_CUDA_CHECK(cudaEventRecord(unsettled->done, stream));
      unsettled->recorded = true;
      unsettled.reset();
    }
    return true;
  }

  /// settled() until true or `timeout`; aborts the communicator on timeout.
  void settle(int rank, Duration timeout, const std::string& what) {
    const auto deadline = deadline_after(timeout);
    Backoff backoff;
    while (!settled(rank, what)) {
      if (Clock::now() >= deadline) {
        abort_comm();
        raise<TimeoutError>("rank {}: {}: the {} did not become ready within {} ms", rank, what, name(),
                            timeout.count());
      }
      backoff.pause();
    }
  }
};

using ChannelKey = std::tuple<int, int, int>;  // (src, dst, channel)

/// Whether the CUDA driver loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2): the
/// driver's own answer, which also covers a variable set after CUDA was initialized. False when the driver cannot
/// say (drivers before 11.7 load eagerly).
bool lazy_module_loading() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 11070, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();  // clear it: not an error of the caller's
    return false;
  }
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  return reinterpret_cast<PFN_cuModuleGetLoadingMode_v11070>(fn)(&mode) == CUDA_SUCCESS &&
         mode == CU_MODULE_LAZY_LOADING;
}

Duration remaining(Clock::time_point deadline) {
  return std::max(Duration(0), std::chrono::duration_cast<Duration>(deadline - Clock::now()));
}

}  // namespace
}  // namespace detail

struct NcclTransport::Impl {
  int rank = 0;
  int world = 1;
  int device = 0;
  int channels = kDefaultChannelsPerLink;
  std::shared_ptr<Transport> host;  // bootstrap, all_reduce_sum, barrier, abort
  NcclOptions options;              // as given to the constructor; split() derives the group's from them
  std::vector<std::pair<int, int>> all_links;
  std::map<detail::ChannelKey, detail::Channel> mine;  // the channels this rank is an end of
  /// The communicator of every rank, for all_reduce_sum_async (gradient buckets); created and warmed up by the
  /// constructor when NcclOptions::collective.
  std::unique_ptr<detail::Channel> collective;
  std::int64_t async_reductions = 0;  // operations posted on `collective` so far: numbers them in errors
  // Whether the first reduce_scatter_sum / all_gather compared what the ranks pass (detail::check_ranks_agree).
  bool checked_reduce_scatter = false;
  bool checked_all_gather = false;
  /// Held by the user's thread while it calls NCCL or changes a channel, and by the watchdog's abort: so that a
  /// communicator is never aborted (freed) under a call on it. Never held while waiting for a peer. Recursive: a
  /// Work destroyed while its post() unwinds locks it again.
  std::recursive_mutex comms;
  /// NcclOptions::stream_waits: polls the stream-waited receives; created last by init(), destroyed first.
  std::unique_ptr<detail::Watchdog> watchdog;

  ~Impl() {
    // First: its thread polls the channels and may abort them (its polls point into this Impl).
    watchdog.reset();
    // Destructors must not throw and must not hang: finalize politely with a deadline, abort otherwise.
    if (collective) mine.emplace(detail::ChannelKey{-1, -1, -1}, std::move(*collective));
    for (auto& [key, ch] : mine) {
      if (ch.comm != nullptr) {
        bool clean = false;
        if (!ch.broken) {
          const ncclResult_t rc = ncclCommFinalize(ch.comm);  // flushes pending operations
          clean = rc == ncclSuccess || rc == ncclInProgress;
        }
        const auto deadline = Clock::now() + Duration(10000);
        detail::Backoff backoff;
        ncclResult_t state = ncclInProgress;
        while (clean) {
          if (ncclCommGetAsyncError(ch.comm, &state) != ncclSuccess || state != ncclInProgress) break;
          if (Clock::now() >= deadline) {
            clean = false;
            break;
          }
          backoff.pause();
        }
        if (clean && state == ncclSuccess) {
          ncclCommDestroy(ch.comm);
        } else {
          ncclCommAbort(ch.comm);
        }
        ch.comm = nullptr;
      }
      if (ch.stream != nullptr) cudaStreamDestroy(ch.stream);
    }
  }

  detail::Channel& channel(int src, int dst, const char* what, const P2POptions& options) {
    TWOBP_CHECK(options.channel < channels, UsageError,
                "rank {}: {} {}: channel {} does not exist (NcclOptions::channels is {})", rank, what,
                detail::describe_op(options), options.channel, channels);
    auto it = mine.find({src, dst, options.channel});
    TWOBP_CHECK(it != mine.end(), UsageError,
                "rank {}: {} {}: there is no NCCL link {} -> {}; list it in NcclOptions::links (the same list on "
                "every rank)",
                rank, what, detail::describe_op(options), src, dst);
    TWOBP_CHECK(!it->second.broken, TransportError,
                "rank {}: {} {}: the {} was aborted after an earlier timeout or error", rank, what,
                detail::describe_op(options), it->second.name());
    return it->second;
  }

  /// The caller holds `comms` (or no other thread can see this Impl yet).
  void abort_all() {
    for (auto& [key, ch] : mine) ch.abort_comm();
    if (collective) collective->abort_comm();
  }

  /// Raises the watchdog's error (a stream-side wait that timed out or failed) at the start of every call.
  void check_watchdog() const {
    if (watchdog) watchdog->check();
  }

  /// The watchdog's poll of a stream-waited receive, on its thread: true once the done event completed. Throws on
  /// a CUDA error, or on the communicator's asynchronous NCCL error (a dead peer), read when the user thread is
  /// not using the communicators at that moment (the next poll tries again otherwise).
  bool poll_stream_wait(const detail::Channel& ch, const detail::PendingDone& done) {
    thread_local int current = -1;  // the watchdog's thread: set the device once
    if (current != device) {
      TWOBP_CUDA_CHECK(cudaSetDevice(device));
      current = device;
    }
    const cudaError_t q = cudaEventQuery(done.done);
    if (q == cudaSuccess) return true;
    TWOBP_CHECK(q == cudaErrorNotReady, TransportError, "cudaEventQuery failed: {}", cudaGetErrorString(q));
    std::unique_lock<std::recursive_mutex> lock(comms, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    TWOBP_CHECK(!ch.broken && ch.comm != nullptr, TransportError, "the {} was aborted", ch.name());
    ncclResult_t state = ncclSuccess;
    TWOBP_NCCL_CHECK(ncclCommGetAsyncError(ch.comm, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      detail::raise<TransportError>("the {} failed: {}: {} (NCCL_DEBUG=WARN prints NCCL's log)", ch.name(),
                                    ncclGetErrorString(state), ncclGetLastError(ch.comm));
    }
    return false;
  }

  /// Creates `collective` (a communicator of every rank) and runs one all-reduce on it, so that its connections
  /// are made now, while every rank is in the constructor, not in the middle of a step.
  void create_collective(Clock::time_point deadline, Duration init_timeout);

  /// Broadcasts rank 0's bytes over the host transport: an all-reduce of int64 values in which only rank 0
  /// contributes (exact, and it needs nothing from the host but all_reduce_sum).
  std::vector<std::uint8_t> broadcast(const std::vector<std::uint8_t>& bytes, Duration timeout) {
    const std::size_t size = bytes.size();  // the same on every rank (callers size it from rank 0's data)
    at::Tensor t = at::zeros({static_cast<std::int64_t>(size)}, at::kLong);
    if (rank == 0) {
      auto* p = t.data_ptr<std::int64_t>();
      for (std::size_t k = 0; k < size; ++k) p[k] = bytes[k];
    }
    host->all_reduce_sum(t, timeout);
    std::vector<std::uint8_t> out(size);
    const auto* p = t.data_ptr<std::int64_t>();
    for (std::size_t k = 0; k < size; ++k) out[k] = static_cast<std::uint8_t>(p[k]);
    return out;
  }

  void init(const NcclOptions& options);
  void warm_up(Clock::time_point deadline, Duration init_timeout);
};

void NcclTransport::Impl::init(const NcclOptions& options) {
  const auto deadline = detail::deadline_after(options.init_timeout);
  this->options = options;
  rank = host->rank();
  world = host->world_size();
  channels = options.channels;
  TWOBP_CHECK(channels >= 1, UsageError, "rank {}: NcclOptions::channels must be >= 1, got {}", rank, channels);

  int count = 0;
  TWOBP_CUDA_CHECK(cudaGetDeviceCount(&count));
  // Before anything is posted: see the class comment (REQUIRES EAGER KERNEL LOADING) for the deadlock it avoids.
  TWOBP_CHECK(!detail::lazy_module_loading(), UsageError,
              "rank {}: NcclTransport: CUDA loads kernels lazily (CUDA_MODULE_LOADING is LAZY or unset), which can "
              "deadlock a pipeline: the first launch of a kernel waits for the GPU's queue to drain, and a posted "
              "NCCL receive never drains until its peer -- blocked the same way -- sends. Start every rank with "
              "CUDA_MODULE_LOADING=EAGER in its environment (e.g. `CUDA_MODULE_LOADING=EAGER torchrun ...`)",
              rank);
  device = options.device >= 0 ? options.device : choose_cuda_device(options.local_rank, options.local_size, count);
  TWOBP_CHECK(device < count, UsageError, "rank {}: NcclTransport: CUDA device {} does not exist ({} visible)", rank,
              device, count);
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // Load cuBLAS's and cuBLASLt's kernels into this context now, before any NCCL kernel can spin: the first handle
  // loads them (cublasCreate -> cuKernelGetFunction), a load that may wait for the GPU's queue to drain (it does
  // under lazy loading; under eager loading this was not isolated). Seen: rank 0 of a 2-process pipeline on an H200
  // stuck in cublasCreate beside its posted receives (docs/GPU.md); with this and the executor's rule for posting
  // receives (ExecutorOptions::prefetch_receives) that pipeline passed. The handles take their workspace from the
  // caching allocator, which a C++ program has not initialized before its first CUDA tensor: initialize CUDA first
  // (without it: "Allocator not initialized for device", seen on the H200 the same day).
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  at::cuda::getCurrentCUDABlasHandle();
  at::cuda::getCurrentCUDABlasLtHandle();

  all_links = options.links.empty() ? ring_links(world) : options.links;
  for (const auto& [src, dst] : all_links) {
    TWOBP_CHECK(src >= 0 && src < world && dst >= 0 && dst < world && src != dst, UsageError,
                "rank {}: NcclOptions::links: invalid link {} -> {} (world size {})", rank, src, dst, world);
  }
  std::sort(all_links.begin(), all_links.end());
  all_links.erase(std::unique(all_links.begin(), all_links.end()), all_links.end());

  // Bootstrap: rank 0 sends its link list and channel count (every rank compares them with its own), then one
  // NCCL unique id per (link, channel).
  std::vector<std::uint8_t> shape(16, 0);
  const std::int64_t header[2] = {static_cast<std::int64_t>(all_links.size()), channels};
  std::memcpy(shape.data(), header, sizeof(header));
  shape = broadcast(shape, detail::remaining(deadline));
  std::int64_t root_header[2];
  std::memcpy(root_header, shape.data(), sizeof(root_header));
  constexpr std::size_t kPerComm = 2 * sizeof(std::int32_t) + sizeof(ncclUniqueId);
  const std::size_t n_comms = static_cast<std::size_t>(root_header[0] * root_header[1]);
  TWOBP_CHECK(root_header[1] == channels, UsageError,
              "rank {}: NcclOptions::channels is {} here but {} on rank 0: every rank must pass the same value", rank,
              channels, root_header[1]);
  std::vector<std::uint8_t> blob(static_cast<std::size_t>(root_header[0]) * root_header[1] * kPerComm);
  if (rank == 0) {
    std::size_t k = 0;
    for (const auto& [src, dst] : all_links) {
      for (int c = 0; c < channels; ++c, ++k) {
        std::uint8_t* p = blob.data() + k * kPerComm;
        const std::int32_t ends[2] = {src, dst};
        std::memcpy(p, ends, sizeof(ends));
        ncclUniqueId id;
        TWOBP_NCCL_CHECK(ncclGetUniqueId(&id));
        std::memcpy(p + sizeof(ends), &id, sizeof(id));
      }
    }
  }
  blob = broadcast(blob, detail::remaining(deadline));
  std::vector<std::pair<int, int>> root_links;
  std::vector<ncclUniqueId> ids(n_comms);
  for (std::size_t k = 0; k < n_comms; ++k) {
    const std::uint8_t* p = blob.data() + k * kPerComm;
    std::int32_t ends[2];
    std::memcpy(ends, p, sizeof(ends));
    if (k % channels == 0) root_links.emplace_back(ends[0], ends[1]);
    std::memcpy(&ids[k], p + sizeof(ends), sizeof(ncclUniqueId));
  }
  // Disagreeing ranks would wait for each other's communicators until the timeout: say what differs instead.
  // (All ranks see rank 0's list, so all of them raise.)
  TWOBP_CHECK(root_links == all_links, UsageError,
              "rank {}: NcclOptions::links differ from rank 0's ({} links here, {} on rank 0): every rank must "
              "pass the same list",
              rank, all_links.size(), root_links.size());

  // Eager creation in one global order. WHY a group: one thread creates several communicators whose peers
  // create theirs in the same global order; grouped, NCCL connects them together instead of deadlocking on
  // the first one. WHY nonblocking: so a missing peer makes us time out instead of hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  try {
    TWOBP_NCCL_CHECK(ncclGroupStart());
    std::size_t k = 0;
    for (const auto& [src, dst] : all_links) {
      for (int c = 0; c < channels; ++c, ++k) {
        if (src != rank && dst != rank) continue;
        detail::Channel& ch = mine[{src, dst, c}];
        ch.src = src;
        ch.dst = dst;
        ch.channel = c;
        TWOBP_NCCL_CHECK(ncclCommInitRankConfig(&ch.comm, 2, ids[k], src == rank ? 0 : 1, &config));
      }
    }
    TWOBP_NCCL_CHECK(ncclGroupEnd());
    for (auto& [key, ch] : mine) {
      ch.settle(rank, detail::remaining(deadline), "creating the communicator");
      // A stream of its own per channel; non-blocking w.r.t. the legacy default stream.
      TWOBP_CUDA_CHECK(cudaStreamCreateWithFlags(&ch.stream, cudaStreamNonBlocking));
    }
    warm_up(deadline, options.init_timeout);
    if (options.collective) create_collective(deadline, options.init_timeout);
  } catch (...) {
    // A half-created set of communicators cannot be finalized politely: abort them all.
    abort_all();
    throw;
  }
  if (options.stream_waits) {
    // The abort runs on the watchdog's thread, under `comms`: no NCCL call of the user's thread is in progress.
    watchdog = std::make_unique<detail::Watchdog>(
        rank,
        [this](const std::string&) {
          std::lock_guard<std::recursive_mutex> lock(comms);
          abort_all();
        },
        "aborted this rank's NCCL communicators");
  }
}

void NcclTransport::Impl::create_collective(Clock::time_point deadline, Duration init_timeout) {
  std::vector<std::uint8_t> id_bytes(sizeof(ncclUniqueId), 0);
  if (rank == 0) {
    ncclUniqueId id;
    TWOBP_NCCL_CHECK(ncclGetUniqueId(&id));
    std::memcpy(id_bytes.data(), &id, sizeof(id));
  }
  id_bytes = broadcast(id_bytes, detail::remaining(deadline));
  ncclUniqueId id;
  std::memcpy(&id, id_bytes.data(), sizeof(id));
  auto ch = std::make_unique<detail::Channel>();
  ch->src = 0;
  ch->dst = world - 1;
  ch->channel = -1;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // a missing rank makes us time out instead of hang
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  TWOBP_NCCL_CHECK(ncclCommInitRankConfig(&ch->comm, world, id, rank, &config));
  collective = std::move(ch);  // owned from here on: abort_all() reaches it if anything below fails
  collective->settle(rank, detail::remaining(deadline), "creating the collective communicator");
  TWOBP_CUDA_CHECK(cudaStreamCreateWithFlags(&collective->stream, cudaStreamNonBlocking));
  // Warm-up: one element summed over every rank connects the communicator now (NCCL connects lazily).
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(c10::Device(c10::kCUDA, device)));
  cudaEvent_t ready = nullptr;
  TWOBP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  TWOBP_CUDA_CHECK(cudaEventRecord(
      ready, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()));
  TWOBP_CUDA_CHECK(cudaStreamWaitEvent(collective->stream, ready, 0));
  cudaEventDestroy(ready);
  TWOBP_NCCL_CHECK(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, collective->comm,
                                 collective->stream));
  collective->settle(rank, detail::remaining(deadline), "warming up the collective communicator");
  detail::Backoff backoff;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(collective->stream);
    if (q == cudaSuccess) break;
    TWOBP_CHECK(q == cudaErrorNotReady, TransportError, "rank {}: warming up the collective communicator: {}", rank,
                cudaGetErrorString(q));
    collective->settled(rank, "warming up the collective communicator");  // raises on an asynchronous NCCL error
    if (Clock::now() >= deadline) {
      detail::raise<TimeoutError>("rank {}: NcclTransport setup: the warm-up all-reduce over all {} ranks did not "
                                  "finish within {} ms (did every rank construct its NcclTransport?)",
                                  rank, world, init_timeout.count());
    }
    backoff.pause();
  }
  const float sum = one.item<float>();  // SYNC POINT, once at construction: the stream is idle already
  TWOBP_CHECK(sum == static_cast<float>(world), TransportError,
              "rank {}: the warm-up all-reduce over {} ranks gave {} instead of {}", rank, world, sum, world);
}

void NcclTransport::Impl::warm_up(Clock::time_point deadline, Duration init_timeout) {
  // One byte src -> dst on every communicator, all in ONE group: NCCL connects every pair now, while all ranks
  // are in the constructor, instead of lazily at a first operation whose peer may be busy posting others.
  at::Tensor byte = at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(c10::Device(c10::kCUDA, device)));
  const auto compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  cudaEvent_t ready = nullptr;
  TWOBP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  TWOBP_CUDA_CHECK(cudaEventRecord(ready, compute.stream()));  // the zeros are written on the compute stream
  TWOBP_NCCL_CHECK(ncclGroupStart());
  for (auto& [key, ch] : mine) {
    TWOBP_CUDA_CHECK(cudaStreamWaitEvent(ch.stream, ready, 0));
    if (ch.src == rank) {
      TWOBP_NCCL_CHECK(ncclSend(byte.data_ptr(), 1, ncclUint8, 1, ch.comm, ch.stream));
    } else {
      TWOBP_NCCL_CHECK(ncclRecv(byte.data_ptr(), 1, ncclUint8, 0, ch.comm, ch.stream));
    }
  }
  TWOBP_NCCL_CHECK(ncclGroupEnd());
  cudaEventDestroy(ready);
  for (auto& [key, ch] : mine) {
    ch.settle(rank, detail::remaining(deadline), "warming up (connecting) the channel");
  }
  // Wait for the transfers themselves: a peer that never constructed its transport shows up here.
  for (auto& [key, ch] : mine) {
    detail::Backoff backoff;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(ch.stream);
      if (q == cudaSuccess) break;
      TWOBP_CHECK(q == cudaErrorNotReady, TransportError, "rank {}: warming up the {}: {}", rank, ch.name(),
                  cudaGetErrorString(q));
      ch.settled(rank, "warming up the channel");  // raises on an asynchronous NCCL error
      if (Clock::now() >= deadline) {
        detail::raise<TimeoutError>("rank {}: NcclTransport setup: the warm-up exchange on the {} did not finish "
                                    "within {} ms (did rank {} construct its NcclTransport?)",
                                    rank, ch.name(), init_timeout.count(), ch.src == rank ? ch.dst : ch.src);
      }
      backoff.pause();
    }
  }
}

namespace detail {
namespace {

class NcclWork final : public Work {
 public:
  /// `what` names the operation in errors ("isend SEND_F stage 1 micro-batch 2 (tag 7) to rank 1").
  /// `stream_wait`: wait() hands the wait to the compute stream and the watchdog (NcclOptions::stream_waits).
  NcclWork(std::shared_ptr<NcclTransport::Impl> impl, Channel* channel, std::string what, bool stream_wait = false)
      : impl_(std::move(impl)), channel_(channel), what_(std::move(what)), stream_wait_(stream_wait) {
    TWOBP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    done_ = std::make_shared<PendingDone>();
    TWOBP_CUDA_CHECK(cudaEventCreateWithFlags(&done_->done, cudaEventDisableTiming));
  }

  ~NcclWork() override {
    // Destroying a recorded, unfinished event is allowed; the buffers are protected by recordStream. An event
    // still waiting to be recorded is dropped by the channel too (it holds the same PendingDone); the done event
    // itself goes with its last owner (the watchdog may still poll it).
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    std::lock_guard<std::recursive_mutex> lock(impl_->comms);
    if (channel_->unsettled == done_) channel_->unsettled.reset();
  }

  cudaEvent_t ready() const { return ready_; }
  const std::shared_ptr<PendingDone>& done() const { return done_; }

  void wait(Duration timeout) override {
    if (finished_) return;
    impl_->check_watchdog();
    if (stream_wait_) return wait_on_stream(timeout);
    const auto deadline = deadline_after(timeout);
    // WHY spin first and sleep at most 50 us: the host of a GPU rank has nothing else to do while it waits, and
    // every microsecond between the transfer's end and the next enqueue is a gap on the GPU. (Waiting on the
    // stream instead, with a watchdog thread for the timeout, as PyTorch's ProcessGroupNCCL does: the
    // stream_waits mode, wait_on_stream.)
    Backoff backoff(std::chrono::microseconds(50), std::chrono::microseconds(2000));
    while (!poll()) {
      if (Clock::now() >= deadline) {
        // The peer never posted the matching operation (or died): abort this channel's communicator so that
        // its kernel stops occupying the stream and the GPU; the channel is unusable afterwards.
        {
          std::lock_guard<std::recursive_mutex> lock(impl_->comms);
          channel_->abort_comm();
        }
        raise<TimeoutError>("rank {}: timed out after {} ms waiting for {}", impl_->rank, timeout.count(), what());
      }
      backoff.pause();
    }
    finish();
  }

  bool is_completed() override {
    if (finished_) return true;
    impl_->check_watchdog();
    if (!poll()) return false;
    finish();
    return true;
  }

 private:
  const std::string& what() const { return what_; }

  bool poll() {
    std::lock_guard<std::recursive_mutex> lock(impl_->comms);
    // A dead peer or network failure shows up as an asynchronous communicator error, not as a CUDA error; an
    // enqueue still in progress is completed (its done event recorded) here.
    if (!channel_->settled(impl_->rank, what())) return false;
    if (!done_->recorded) return false;  // cannot happen once settled; kept as a guard against a dropped event
    const cudaError_t q = cudaEventQuery(done_->done);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) {
      raise<TransportError>("rank {}: {}: cudaEventQuery failed: {}", impl_->rank, what(), cudaGetErrorString(q));
    }
    return false;
  }

  /// NcclOptions::stream_waits: settles the enqueue on the host (local after the warm-up: no peer involved), so
  /// that the done event is recorded, then makes the compute stream wait for it and leaves the rest to the watchdog.
  void wait_on_stream(Duration timeout) {
    const auto deadline = deadline_after(timeout);
    Backoff backoff(std::chrono::microseconds(50), std::chrono::microseconds(2000));
    for (;;) {
      {
        std::lock_guard<std::recursive_mutex> lock(impl_->comms);
        if (channel_->settled(impl_->rank, what())) break;
        if (Clock::now() >= deadline) {
          channel_->abort_comm();
          raise<TimeoutError>("rank {}: timed out after {} ms waiting for NCCL to enqueue {}", impl_->rank,
                              timeout.count(), what());
        }
      }
      backoff.pause();
    }
    TWOBP_CHECK(done_->recorded, TransportError, "rank {}: {}: the done event was never recorded", impl_->rank,
                what());
    const cudaError_t q = cudaEventQuery(done_->done);
    TWOBP_CHECK(q == cudaSuccess || q == cudaErrorNotReady, TransportError, "rank {}: {}: cudaEventQuery failed: {}",
                impl_->rank, what(), cudaGetErrorString(q));
    finish();  // SYNC POINT on the stream, not the host
    if (q == cudaSuccess) return;  // arrived already: nothing to watch
    // The poll points into the Impl (not a shared_ptr: the Impl owns the watchdog), which outlives it.
    impl_->watchdog->watch(what(), timeout,
                           [impl = impl_.get(), channel = channel_, done = done_] {
                             return impl->poll_stream_wait(*channel, *done);
                           });
  }

  void finish() {
    finished_ = true;
    c10::cuda::CUDAGuard guard(impl_->device);
    // SYNC POINT (consumer side): the caller continues on its current compute stream, which may differ from
    // the one current at isend/irecv. Ordering it after the done event makes a received tensor safe to read
    // and a sent one safe to overwrite on that stream. (Host waits: the event has completed, so this costs
    // nothing; it keeps the contract independent of the host-side polling above. Stream waits: this IS the wait.)
    TWOBP_CUDA_CHECK(
        cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(impl_->device).stream(), done_->done, 0));
  }

  std::shared_ptr<NcclTransport::Impl> impl_;
  Channel* channel_;  // owned by impl_->mine or impl_->collective (stable addresses)
  std::string what_;
  bool stream_wait_ = false;
  cudaEvent_t ready_ = nullptr;
  std::shared_ptr<PendingDone> done_;
  bool finished_ = false;
};

}  // namespace
}  // namespace detail

NcclTransport::NcclTransport(std::shared_ptr<Transport> host, NcclOptions options) : impl_(std::make_shared<Impl>()) {
  TWOBP_CHECK(host != nullptr, UsageError, "NcclTransport: the host transport is null");
  TWOBP_CHECK(host->device().is_cpu(), UsageError,
              "NcclTransport: the host transport ({}) must move CPU tensors (MpiTransport, StoreTransport)",
              host->name());
  impl_->host = std::move(host);
  impl_->init(options);
}

#if TWOBP_HAVE_MPI
namespace {
NcclOptions with_local(NcclOptions options, const MpiEnvironment& env) {
  options.local_rank = env.local_rank();
  options.local_size = env.local_size();
  return options;
}
}  // namespace

NcclTransport::NcclTransport(const MpiEnvironment& env, NcclOptions options)
    : NcclTransport(std::make_shared<MpiTransport>(env), with_local(std::move(options), env)) {}
#endif

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
  im.check_watchdog();
  detail::check_p2p_args(what, im.rank, im.world, tensor, options);
  TWOBP_CHECK(tensor.is_cuda() && tensor.device().index() == im.device, UsageError,
              "rank {}: {} {}: NcclTransport moves tensors on cuda:{}, got one on {}", im.rank, what,
              detail::describe_op(options), im.device, tensor.device().str());
  std::lock_guard<std::recursive_mutex> lock(im.comms);  // no watchdog abort while this posts
  detail::Channel& ch = is_send ? im.channel(im.rank, options.peer, what, options)
                                : im.channel(options.peer, im.rank, what, options);
  const std::string op = fmt::format("{} {}", what, detail::describe_op(options));
  // NCCL forbids a new call on a nonblocking communicator whose previous one is still being enqueued. After the
  // warm-up this is a local matter (no peer involved); it is bounded by the caller's timeout all the same.
  ch.settle(im.rank, options.timeout, op);
  const int peer_in_comm = ch.src == im.rank ? 1 : 0;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(im.device));
  const auto compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(im.device));
  auto work = std::make_unique<detail::NcclWork>(
      impl_, &ch, fmt::format("{} {} rank {}", detail::describe_op(options), is_send ? "to" : "from", options.peer),
      /*stream_wait=*/!is_send && im.options.stream_waits);

  // SYNC POINT (producer side): the tensor was produced -- for a receive buffer: last used -- by work queued on
  // the compute stream. The channel stream must not read (send) or overwrite (receive) it before that finished.
  TWOBP_CUDA_CHECK(cudaEventRecord(work->ready(), compute.stream()));
  TWOBP_CUDA_CHECK(cudaStreamWaitEvent(ch.stream, work->ready(), 0));
  const std::size_t bytes = tensor.nbytes();
  if (bytes > 0) {  // both ends agree on the size, so both skip an empty transfer
    // Bytes, not elements: every dtype (fp8, complex, bool) travels the same way.
    if (is_send) {
      TWOBP_NCCL_CHECK(ncclSend(tensor.data_ptr(), bytes, ncclUint8, peer_in_comm, ch.comm, ch.stream));
    } else {
      TWOBP_NCCL_CHECK(ncclRecv(tensor.data_ptr(), bytes, ncclUint8, peer_in_comm, ch.comm, ch.stream));
    }
    // SYNC POINT (memory lifetime): the caching allocator would give this memory to a new tensor as soon as the
    // caller drops its reference, although the channel stream may still be using it. recordStream delays reuse
    // until the work queued so far on the channel stream is done.
    c10::cuda::CUDACachingAllocator::recordStream(
        tensor.storage().data_ptr(),
        c10::cuda::getStreamFromExternal(ch.stream, static_cast<c10::DeviceIndex>(im.device)));
  }
  // Never block here on the peer: if NCCL is still enqueuing (nonblocking communicator), the done event is
  // recorded when the communicator settles (Work polls, or the next post on this channel).
  ch.unsettled = work->done();
  ch.settled(im.rank, op);
  return work;
}

void NcclTransport::all_reduce_sum(at::Tensor& tensor, Duration timeout) {
  impl_->check_watchdog();
  TWOBP_CHECK(tensor.defined(), UsageError, "rank {}: all_reduce_sum of an undefined tensor", impl_->rank);
  // WHY over the host transport on a CPU copy: this is for a handful of scalars (loss, gradient norm). The
  // device-to-host copy synchronizes with the compute stream that produced the values; a world NCCL
  // communicator would cost memory and setup time on every rank for no measurable gain.
  if (tensor.is_cpu() && tensor.is_contiguous()) {  // host values (losses, norms): no copies at all
    impl_->host->all_reduce_sum(tensor, timeout);
    return;
  }
  at::Tensor cpu = tensor.to(c10::kCPU).contiguous();
  impl_->host->all_reduce_sum(cpu, timeout);
  tensor.copy_(cpu);
}

namespace detail {
namespace {

/// NCCL's type for summing `dtype`; UsageError naming `what` for a dtype NCCL cannot sum.
ncclDataType_t nccl_sum_type(c10::ScalarType dtype, int rank, const char* what) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default: raise<UsageError>("rank {}: {}: dtype {} cannot be summed by NCCL", rank, what, c10::toString(dtype));
  }
}

/// UsageError unless `t` is on this rank's GPU (what NcclTransport's collectives of every rank move).
void check_on_device(const NcclTransport::Impl& im, const at::Tensor& t, const char* what) {
  TWOBP_CHECK(t.is_cuda() && t.device().index() == im.device, UsageError,
              "rank {}: {}: NcclTransport moves tensors on cuda:{} (or the CPU, through its host transport), got one "
              "on {}",
              im.rank, what, im.device, t.device().str());
}

/// Posts `enqueue` (one NCCL collective on the communicator of every rank, NcclTransport::Impl::collective) on that
/// communicator's stream, after the work queued so far on the current compute stream (where its buffers were
/// produced, or last used). `buffers`: the tensors it reads or writes, kept from reuse until its stream is past it.
/// `what` names it in errors ("reduce_scatter_sum #3").
std::unique_ptr<Work> post_collective(const std::shared_ptr<NcclTransport::Impl>& impl, const std::string& what,
                                      Duration timeout, const std::vector<at::Tensor>& buffers,
                                      const std::function<void(Channel&)>& enqueue) {
  auto& im = *impl;
  // WHY a communicator of every rank: gradient buckets and shards are large and reduced while the pipeline runs;
  // staying on the GPU, on a stream of their own, is what lets them overlap compute.
  TWOBP_CHECK(im.collective != nullptr, UsageError,
              "rank {}: {}: this NcclTransport was built with NcclOptions::collective = false; build it with true "
              "(the default) to reduce gradient buckets on the GPU",
              im.rank, what);
  std::lock_guard<std::recursive_mutex> lock(im.comms);  // no watchdog abort while this posts
  Channel& ch = *im.collective;
  ch.settle(im.rank, timeout, what);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(im.device));
  const auto compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(im.device));
  auto work = std::make_unique<NcclWork>(impl, &ch, what);
  // SYNC POINT: the buffers were filled on the compute stream.
  TWOBP_CUDA_CHECK(cudaEventRecord(work->ready(), compute.stream()));
  TWOBP_CUDA_CHECK(cudaStreamWaitEvent(ch.stream, work->ready(), 0));
  enqueue(ch);
  // SYNC POINT (memory lifetime): see post(); the collective's stream may still use them after the caller let go.
  for (const at::Tensor& b : buffers) {
    if (b.numel() == 0) continue;  // no memory, nothing NCCL touched
    c10::cuda::CUDACachingAllocator::recordStream(
        b.storage().data_ptr(), c10::cuda::getStreamFromExternal(ch.stream, static_cast<c10::DeviceIndex>(im.device)));
  }
  ch.unsettled = work->done();
  ch.settled(im.rank, what);
  return work;
}

/// A collective posted on padded buffers (NCCL's reduce-scatter and all-gather take the same count from every rank,
/// and shard_range's shards differ by one element when world_size does not divide n): once the NCCL work is done
/// and the current stream waits for it (the inner wait()), `copy_out` moves the result out of `padded` into the
/// caller's tensor, on the current stream, once.
class CopyOutWork final : public Work {
 public:
  CopyOutWork(std::unique_ptr<Work> inner, int device, at::Tensor padded, std::function<void()> copy_out)
      : inner_(std::move(inner)), device_(static_cast<c10::DeviceIndex>(device)), padded_(std::move(padded)),
        copy_out_(std::move(copy_out)) {}

  void wait(Duration timeout) override {
    if (finished_) return;
    inner_->wait(timeout);
    finish();
  }

  bool is_completed() override {
    if (finished_) return true;
    if (!inner_->is_completed()) return false;
    finish();
    return true;
  }

 private:
  void finish() {
    finished_ = true;
    c10::cuda::CUDAGuard guard(device_);
    copy_out_();
    // SYNC POINT (memory lifetime): the copy reads the padded buffer on the current stream, which need not be the
    // stream that allocated it: it must not be reused before that copy ran.
    c10::cuda::CUDACachingAllocator::recordStream(padded_.storage().data_ptr(), c10::cuda::getCurrentCUDAStream(device_));
    padded_.reset();
  }

  std::unique_ptr<Work> inner_;
  c10::DeviceIndex device_;
  at::Tensor padded_;
  std::function<void()> copy_out_;
  bool finished_ = false;
};

}  // namespace
}  // namespace detail

std::unique_ptr<Work> NcclTransport::all_reduce_sum_async(at::Tensor& tensor, Duration timeout) {
  auto& im = *impl_;
  im.check_watchdog();
  TWOBP_CHECK(tensor.defined() && tensor.is_cuda() && tensor.device().index() == im.device && tensor.is_contiguous(),
              UsageError, "rank {}: all_reduce_sum_async: NcclTransport reduces contiguous tensors on cuda:{}, got {}",
              im.rank, im.device, tensor.defined() ? tensor.device().str() : std::string("an undefined tensor"));
  const ncclDataType_t type = detail::nccl_sum_type(tensor.scalar_type(), im.rank, "all_reduce_sum_async");
  const std::string what = fmt::format("all_reduce_sum_async #{}", im.async_reductions++);
  return detail::post_collective(impl_, what, timeout, {tensor}, [&](detail::Channel& ch) {
    if (tensor.numel() == 0) return;  // every rank has the same numel: all skip it
    TWOBP_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<std::size_t>(tensor.numel()),
                                   type, ncclSum, ch.comm, ch.stream));
  });
}

void NcclTransport::reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) {
  reduce_scatter_sum_async(input, output, timeout)->wait(timeout);
}

std::unique_ptr<Work> NcclTransport::reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                              Duration timeout) {
  auto& im = *impl_;
  im.check_watchdog();
  const std::string who = fmt::format("rank {}", im.rank);
  detail::check_reduce_scatter_args(who, im.world, im.rank, input, output);
  if (input.is_cpu()) {  // host values: over the host transport, as all_reduce_sum
    im.host->reduce_scatter_sum(input, output, timeout);
    return detail::completed_work();
  }
  detail::check_on_device(im, input, "reduce_scatter_sum");
  const ncclDataType_t type = detail::nccl_sum_type(input.scalar_type(), im.rank, "reduce_scatter_sum");
  if (!im.checked_reduce_scatter) {
    detail::check_ranks_agree(*im.host, who, "reduce_scatter_sum", input.numel(), input.scalar_type(), timeout);
    im.checked_reduce_scatter = true;
  }
  const std::string what = fmt::format("reduce_scatter_sum #{}", im.async_reductions++);
  const std::int64_t n = input.numel(), world = im.world, q = n / world, m = n % world, c = q + (m > 0 ? 1 : 0);
  if (n == 0) return detail::completed_work();  // every rank has the same n: all skip it
  at::Tensor send = input, recv = output;
  if (m > 0) {
    // Row r of a [world, c] buffer holds rank r's shard, zero-padded to c: NCCL's reduce-scatter then gives this
    // rank the sum of its rows, whose first shard-size elements are its shard. Filled on the compute stream.
    send = at::zeros({world, c}, input.options());
    send.narrow(0, 0, m).copy_(input.narrow(0, 0, m * c).view({m, c}));
    if (q > 0) send.narrow(0, m, world - m).narrow(1, 0, q).copy_(input.narrow(0, m * c, (world - m) * q).view({world - m, q}));
    recv = at::empty({c}, input.options());
  }
  auto work = detail::post_collective(impl_, what, timeout, {send, recv}, [&](detail::Channel& ch) {
    TWOBP_NCCL_CHECK(ncclReduceScatter(send.data_ptr(), recv.data_ptr(), static_cast<std::size_t>(c), type, ncclSum,
                                       ch.comm, ch.stream));
  });
  if (m == 0) return work;
  const std::int64_t mine = output.numel();
  return std::make_unique<detail::CopyOutWork>(std::move(work), im.device, recv,
                                               [recv, output, mine]() mutable { output.copy_(recv.narrow(0, 0, mine)); });
}

void NcclTransport::all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  all_gather_async(shard, output, timeout)->wait(timeout);
}

std::unique_ptr<Work> NcclTransport::all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  auto& im = *impl_;
  im.check_watchdog();
  const std::string who = fmt::format("rank {}", im.rank);
  detail::check_all_gather_args(who, im.world, im.rank, shard, output);
  if (shard.is_cpu()) {  // host values: over the host transport
    im.host->all_gather(shard, output, timeout);
    return detail::completed_work();
  }
  detail::check_on_device(im, shard, "all_gather");
  if (!im.checked_all_gather) {
    detail::check_ranks_agree(*im.host, who, "all_gather", output.numel(), output.scalar_type(), timeout);
    im.checked_all_gather = true;
  }
  const std::string what = fmt::format("all_gather #{}", im.async_reductions++);
  const std::int64_t n = output.numel(), world = im.world, q = n / world, m = n % world, c = q + (m > 0 ? 1 : 0);
  if (n == 0) return detail::completed_work();  // every rank has the same n: all skip it
  at::Tensor send = shard, recv = output;
  if (m > 0) {
    // Every rank sends c elements (its shard, zero-padded) into row r of a [world, c] buffer; the rows' first
    // shard-size elements are then copied out in order. The padding is filled on the compute stream.
    send = at::zeros({c}, output.options());
    send.narrow(0, 0, shard.numel()).copy_(shard);
    recv = at::empty({world, c}, output.options());
  }
  // Bytes, so that every dtype travels.
  const auto bytes = static_cast<std::size_t>(c) * output.element_size();
  auto work = detail::post_collective(impl_, what, timeout, {send, recv}, [&](detail::Channel& ch) {
    TWOBP_NCCL_CHECK(ncclAllGather(send.data_ptr(), recv.data_ptr(), bytes, ncclUint8, ch.comm, ch.stream));
  });
  if (m == 0) return work;
  return std::make_unique<detail::CopyOutWork>(std::move(work), im.device, recv, [recv, output, m, q, c, world]() mutable {
    output.narrow(0, 0, m * c).view({m, c}).copy_(recv.narrow(0, 0, m));
    if (q > 0) output.narrow(0, m * c, (world - m) * q).view({world - m, q}).copy_(recv.narrow(0, m, world - m).narrow(1, 0, q));
  });
}

void NcclTransport::barrier(Duration timeout) {
  impl_->check_watchdog();
  impl_->host->barrier(timeout);
}

std::shared_ptr<StatusBoard> NcclTransport::status_board() const { return impl_->host->status_board(); }

void NcclTransport::broadcast(at::Tensor& tensor, int root, Duration timeout) {
  impl_->check_watchdog();
  TWOBP_CHECK(tensor.defined(), UsageError, "rank {}: broadcast of an undefined tensor", impl_->rank);
  // Over the host transport on a CPU copy, like all_reduce_sum (see there); the copy back lands on this rank's
  // current stream.
  at::Tensor cpu = tensor.to(c10::kCPU).contiguous();
  impl_->host->broadcast(cpu, root, timeout);
  tensor.copy_(cpu);
}

std::unique_ptr<Transport> NcclTransport::split(int color, int key, Duration timeout) {
  // The host transport splits first (a timed collective over every rank of this transport); the group's NCCL
  // communicators are then bootstrapped through the group's host exactly as this transport's were: its ids never
  // travel outside the group. UNTESTED on GPUs so far (no GPU where it was written).
  impl_->check_watchdog();
  std::unique_ptr<Transport> group_host = impl_->host->split(color, key, timeout);
  if (!group_host) return nullptr;
  NcclOptions options = impl_->options;
  options.device = impl_->device;  // the group lives on this rank's GPU
  options.links.clear();           // the group's own ring (links name group ranks)
  options.init_timeout = timeout;
  return std::make_unique<NcclTransport>(std::shared_ptr<Transport>(std::move(group_host)), std::move(options));
}

void NcclTransport::abort(const std::string& reason) {
  // Abort the communicators first: the host's abort may take a moment (MPI_Abort kills the job), and the peers'
  // NCCL kernels should not wait on ours meanwhile.
  {
    std::lock_guard<std::recursive_mutex> lock(impl_->comms);
    impl_->abort_all();
  }
  impl_->host->abort(reason);
}

}  // namespace twobp

#endif  // TWOBP_HAVE_NCCL
