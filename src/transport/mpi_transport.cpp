// MpiEnvironment and MpiTransport. Every MPI call is checked (TWOBP_MPI_CHECK); every wait polls MPI_Test with
// a deadline, because MPI has no timed wait and a hung peer must turn into a TimeoutError, not a hung job.

#include "twobp/transport/mpi.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "transport/common.h"
#include "transport/mpi_check.h"
#include "twobp/transport/status_board.h"
#include "util/check.h"

namespace twobp {

// ---------------------------------------------------------------------------------------------------------------
// MpiEnvironment

MpiEnvironment::MpiEnvironment() { init(nullptr, nullptr); }

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) { init(argc, argv); }

void MpiEnvironment::init(int* argc, char*** argv) {
  int finalized = 0;
  TWOBP_MPI_CHECK(MPI_Finalized(&finalized));
  TWOBP_CHECK(!finalized, UsageError, "MpiEnvironment: MPI was already finalized in this process");
  int initialized = 0;
  TWOBP_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    // MULTIPLE lets several threads (e.g. a communication thread) use MPI; we accept less and serialize.
    TWOBP_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level_));
    initialized_here_ = true;
  } else {
    TWOBP_MPI_CHECK(MPI_Query_thread(&thread_level_));
  }
  TWOBP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  TWOBP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size_));
  MPI_Comm node = MPI_COMM_NULL;
  TWOBP_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  TWOBP_MPI_CHECK(MPI_Comm_rank(node, &local_rank_));
  TWOBP_MPI_CHECK(MPI_Comm_size(node, &local_size_));
  TWOBP_MPI_CHECK(MPI_Comm_free(&node));
}

MpiEnvironment::~MpiEnvironment() {
  if (!initialized_here_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool MpiEnvironment::thread_multiple() const { return thread_level_ >= MPI_THREAD_MULTIPLE; }

// ---------------------------------------------------------------------------------------------------------------
// MpiTransport

namespace detail {
namespace {

constexpr std::int32_t kHeaderMagic = 0x74627031;  // "tbp1"
constexpr int kMaxDims = 8;

/// Longest sleep between two MPI_Test calls of a thread that waits for a request (point-to-point or collective).
/// WHY this short: a message over shared memory moves in fragments, each needing a progress call on the waiting side
/// too, and the wait's first MPI_Test after the data is there ends it; the waiting thread has nothing else to do.
/// Sleeping up to 1 ms made a 13 MB all-reduce take ~400 ms, and left standard 1F1B (p = 2, m = 4, 512 KB
/// activations, the peer benchmark's shape) 9-14 ms per step above the simulator fed with the run's own costs; at
/// 20 us it is 0-5 ms above (four alternated runs each, docs/PERFORMANCE.md). The sleeps are sleeps (common.h Backoff, after
/// 16 yields), so a rank waiting on an oversubscribed machine still gives its core away.
constexpr std::chrono::microseconds kWaitPollCap{20};

/// First message of every point-to-point transfer. Fixed size, so the receiver can post it before knowing
/// anything; it carries the full 64-bit tag so that collisions of folded MPI tags are detected.
struct WireHeader {
  std::int32_t magic;
  std::int32_t sender;
  std::int32_t dtype;  // c10::ScalarType
  std::int32_t ndim;
  std::int64_t tag;
  std::int64_t numel;
  std::int64_t dims[kMaxDims];
};
static_assert(sizeof(WireHeader) == 96, "the wire header must have the same layout on every rank");

/// The requests of one operation and everything MPI may still read or write: it must outlive the requests,
/// which is why a timed-out operation is parked (see Impl::park) instead of destroyed.
struct Pending {
  std::array<MPI_Request, 2> requests{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  std::array<bool, 2> done{true, true};
  std::array<int, 2> error{MPI_SUCCESS, MPI_SUCCESS};
  std::array<MPI_Status, 2> status{};
  WireHeader header{};
  at::Tensor tensor;  // payload (send) or the caller's buffer (receive); a collective's result
  at::Tensor input;   // a reduce-scatter's or all-gather's other buffer, which MPI reads until it completes
  std::vector<int> counts, displacements;  // their per-rank counts: MPI may read them until it completes
  std::shared_ptr<void> progress_token;  // keeps the progress thread polling while this operation exists
};

/// Drives MPI's progress engine while point-to-point operations are outstanding.
///
/// WHY: a large message goes by rendezvous, and MPI moves its data only while the *sender* is inside an MPI
/// call. The executor posts an isend and then computes for a long time (the next F or I), so without this
/// thread the receiver would wait for the sender's whole computation. The thread calls MPI_Iprobe (any MPI call
/// runs the progress engine) every ~50 us while an operation is alive and sleeps on a condition variable
/// otherwise. It never touches a request (MPI request handles must not be tested from two threads), so it needs
/// MPI_THREAD_MULTIPLE and is not started without it.
///
/// Polling backs off from 20 us to 500 us and restarts at 20 us whenever an operation is posted: a message is
/// most likely to need a nudge right after it was posted, while a thread spinning at 50 us for a whole compute
/// action took ~12% of the step from the compute thread on a 2-core machine (twobp_bench pipeline, 1F1B m=4).
class ProgressThread {
 public:
  explicit ProgressThread(MPI_Comm comm) : comm_(comm), thread_([this] { run(); }) {}
  ~ProgressThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  /// Polling continues while any returned token is alive.
  std::shared_ptr<void> acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++active_;
      ++posted_;
    }
    cv_.notify_all();
    return std::shared_ptr<void>(nullptr, [this](void*) {
      std::lock_guard<std::mutex> lock(mutex_);
      --active_;
    });
  }

 private:
  void run() {
    constexpr std::chrono::microseconds kFirst{20}, kMax{500};
    std::chrono::microseconds pause = kFirst;
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || active_ > 0; });
      if (stop_) return;
      if (posted_ != seen) {
        seen = posted_;
        pause = kFirst;
      }
      lock.unlock();
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(pause);
      pause = std::min(kMax, pause * 2);
      lock.lock();
    }
  }

  MPI_Comm comm_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int active_ = 0;
  std::uint64_t posted_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: started after the state above exists
};

std::string shape_of(const WireHeader& h) {
  const int ndim = std::max(0, std::min<int>(h.ndim, kMaxDims));
  return describe_tensor(at::IntArrayRef(h.dims, static_cast<std::size_t>(ndim)),
                         static_cast<c10::ScalarType>(h.dtype));
}

bool mpi_type_of(c10::ScalarType type, MPI_Datatype* out) {
  switch (type) {
    case c10::kFloat: *out = MPI_FLOAT; return true;
    case c10::kDouble: *out = MPI_DOUBLE; return true;
    case c10::kInt: *out = MPI_INT32_T; return true;
    case c10::kLong: *out = MPI_INT64_T; return true;
    case c10::kShort: *out = MPI_INT16_T; return true;
    case c10::kChar: *out = MPI_INT8_T; return true;
    case c10::kByte: *out = MPI_UINT8_T; return true;
    default: return false;
  }
}

/// The MPI status board (needs MPI_THREAD_MULTIPLE). A communicator of its own (so its two tags never meet the
/// transport's), and a watcher thread, started with the first reader, that every 200 ms looks for a question
/// (MPI_Iprobe) and answers it with its rank's status, even while the rank computes. collect() asks every other
/// rank and waits for the answers until its deadline; an unanswered receive is cancelled. There is no agreement
/// step: an abort under MPI ends the whole job, so the aborting rank's report is the one printed.
class MpiStatusBoard final : public StatusBoard {
 public:
  MpiStatusBoard(MPI_Comm parent, int rank, int world) : rank_(rank), world_(world) {
    TWOBP_MPI_CHECK(MPI_Comm_dup(parent, &comm_));
    TWOBP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  }
  ~MpiStatusBoard() override {
    stop();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  /// Ends the watcher (before MPI_Finalize); collect() then answers with this rank's status only.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    wake_.notify_all();
    if (watcher_.joinable()) watcher_.join();
  }

  void attach(int rank, Reader reader) override {
    std::lock_guard<std::mutex> lock(mutex_);
    reader_ = std::move(reader);
    if (!watcher_.joinable() && !stopped_) watcher_ = std::thread([this] { watch(); });
    (void)rank;
  }
  void detach(int) override {
    std::lock_guard<std::mutex> lock(mutex_);
    reader_ = nullptr;
  }

  std::vector<std::optional<std::string>> collect(int, std::int64_t incident, Duration wait) override {
    std::vector<std::optional<std::string>> out(static_cast<std::size_t>(world_));
    out[static_cast<std::size_t>(rank_)] = own();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return out;
    }
    asked_.push_back(incident);  // the asks' buffer must outlive their (freed) requests: kept for the board's life
    const std::int64_t* question = &asked_.back();
    std::vector<std::vector<char>> answers(static_cast<std::size_t>(world_), std::vector<char>(kMaxAnswer));
    std::vector<MPI_Request> pending(static_cast<std::size_t>(world_), MPI_REQUEST_NULL);
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      MPI_Request ask = MPI_REQUEST_NULL;
      if (MPI_Isend(question, 1, MPI_INT64_T, r, kAskTag, comm_, &ask) == MPI_SUCCESS) MPI_Request_free(&ask);
      MPI_Irecv(answers[r].data(), kMaxAnswer, MPI_CHAR, r, kAnswerTag, comm_, &pending[r]);
    }
    const auto deadline = Clock::now() + wait;
    for (;;) {
      bool all = true;
      for (int r = 0; r < world_; ++r) {
        if (pending[r] == MPI_REQUEST_NULL) continue;
        int flag = 0, count = 0;
        MPI_Status status;
        if (MPI_Test(&pending[r], &flag, &status) != MPI_SUCCESS) {
          pending[r] = MPI_REQUEST_NULL;
          continue;
        }
        if (!flag) {
          all = false;
          continue;
        }
        MPI_Get_count(&status, MPI_CHAR, &count);
        std::int64_t echoed = -1;
        if (count >= static_cast<int>(sizeof(echoed))) std::memcpy(&echoed, answers[r].data(), sizeof(echoed));
        if (echoed == incident) {
          out[r] = std::string(answers[r].data() + sizeof(echoed), static_cast<std::size_t>(count) - sizeof(echoed));
        }
      }
      if (all || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (auto& request : pending) {
      if (request == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);  // a cancelled receive completes at once
    }
    return out;
  }

  std::string agree_on_report(std::int64_t, const std::string& report) override { return report; }

 private:
  static constexpr int kAskTag = 1, kAnswerTag = 2, kMaxAnswer = 1 << 16;

  std::string own() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reader_ ? reader_() : std::string();
  }

  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stopped_; })) {
      lock.unlock();
      int flag = 0;
      MPI_Status status;
      while (MPI_Iprobe(MPI_ANY_SOURCE, kAskTag, comm_, &flag, &status) == MPI_SUCCESS && flag) {
        std::int64_t incident = -1;
        if (MPI_Recv(&incident, 1, MPI_INT64_T, status.MPI_SOURCE, kAskTag, comm_, MPI_STATUS_IGNORE) !=
            MPI_SUCCESS) {
          break;
        }
        std::string answer(sizeof(incident), '\0');
        std::memcpy(answer.data(), &incident, sizeof(incident));
        answer += own().substr(0, kMaxAnswer - sizeof(incident));
        MPI_Send(answer.data(), static_cast<int>(answer.size()), MPI_CHAR, status.MPI_SOURCE, kAnswerTag, comm_);
      }
      lock.lock();
    }
  }

  const int rank_, world_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopped_ = false;
  std::thread watcher_;
  Reader reader_;
  std::deque<std::int64_t> asked_;
};

}  // namespace
}  // namespace detail

struct MpiTransport::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int world = 1;
  bool multiple = false;
  std::int64_t tag_modulus = 0;  // logical tags are folded into [0, tag_modulus)

  std::mutex mpi_mutex;  // serializes MPI calls unless MPI_THREAD_MULTIPLE
  std::mutex parked_mutex;
  std::vector<std::shared_ptr<detail::Pending>> parked;
  std::int64_t collectives = 0;
  std::string collective_failure;  // guarded by parked_mutex
  std::unique_ptr<detail::ProgressThread> progress;  // only with MPI_THREAD_MULTIPLE
  std::shared_ptr<detail::MpiStatusBoard> board;     // only with MPI_THREAD_MULTIPLE
  std::string name;         // empty: "rank <rank>"; in a group: "rank 1 (group color 0, rank 2 in the parent)"
  // Whether the first reduce_scatter_sum / all_gather compared what the ranks pass (detail::check_ranks_agree).
  bool checked_reduce_scatter = false;
  bool checked_all_gather = false;

  std::string who() const { return name.empty() ? fmt::format("rank {}", rank) : name; }

  /// Takes ownership of `c` (a private communicator): errors returned, rank/size/tag range read, progress thread.
  void adopt(MPI_Comm c, bool thread_multiple);

  std::shared_ptr<void> progress_token() { return progress ? progress->acquire() : nullptr; }

  std::unique_lock<std::mutex> serialize() {
    return multiple ? std::unique_lock<std::mutex>() : std::unique_lock<std::mutex>(mpi_mutex);
  }

  int fold(std::int64_t tag) const { return static_cast<int>(tag % tag_modulus); }

  /// Tests every unfinished request once. Returns true when all are done (successfully or with an error).
  /// A failed request is freed by MPI (MPI_ERRORS_RETURN); its code is kept for the caller's message.
  bool test(detail::Pending& p) {
    auto lock = serialize();
    bool all = true;
    for (int i = 0; i < 2; ++i) {
      if (p.done[i]) continue;
      int flag = 0;
      const int rc = MPI_Test(&p.requests[i], &flag, &p.status[i]);
      if (rc != MPI_SUCCESS) {
        p.error[i] = rc;
        p.done[i] = true;
        p.requests[i] = MPI_REQUEST_NULL;
      } else if (flag) {
        p.done[i] = true;
      } else {
        all = false;
      }
    }
    return all;
  }

  /// Cancels what can be cancelled and keeps the operation's buffers alive until MPI is done with them.
  /// WHY: MPI_Request_free on an active request would leave MPI writing into (or reading from) freed memory,
  /// and MPI_Wait has no timeout; parked operations are re-tested by reap() on later calls.
  void park(std::shared_ptr<detail::Pending> p) {
    {
      auto lock = serialize();
      for (int i = 0; i < 2; ++i) {
        if (!p->done[i] && p->requests[i] != MPI_REQUEST_NULL) MPI_Cancel(&p->requests[i]);
      }
    }
    test(*p);
    if (p->done[0] && p->done[1]) return;
    std::lock_guard<std::mutex> lock(parked_mutex);
    parked.push_back(std::move(p));
  }

  void reap() {
    std::vector<std::shared_ptr<detail::Pending>> todo;
    {
      std::lock_guard<std::mutex> lock(parked_mutex);
      if (parked.empty()) return;
      todo.swap(parked);
    }
    std::vector<std::shared_ptr<detail::Pending>> still;
    for (auto& p : todo) {
      if (!test(*p)) still.push_back(std::move(p));
    }
    std::lock_guard<std::mutex> lock(parked_mutex);
    for (auto& p : still) parked.push_back(std::move(p));
  }

  /// Polls a single collective request until done or the deadline (sleeping at most kWaitPollCap between polls).
  void wait_collective(const std::shared_ptr<detail::Pending>& p, const std::string& what, Duration timeout) {
    const auto deadline = detail::deadline_after(timeout);
    detail::Backoff backoff(detail::kWaitPollCap);
    while (!test(*p)) {
      if (Clock::now() >= deadline) {
        // A collective cannot be cancelled: keep its buffer alive and refuse later collectives, whose
        // matching would otherwise be off by one across ranks.
        std::string message = fmt::format("{}: timed out after {} ms in {} (a rank did not call it, or is "
                                          "stuck before it)",
                                          who(), timeout.count(), what);
        {
          std::lock_guard<std::mutex> lock(parked_mutex);
          collective_failure = message;
          parked.push_back(p);
        }
        throw TimeoutError(message);
      }
      backoff.pause();
    }
    if (p->error[0] != MPI_SUCCESS) {
      detail::raise<TransportError>("{}: {} failed: {}", who(), what, detail::mpi_error_string(p->error[0]));
    }
  }

  std::string begin_collective(const char* kind) {
    std::lock_guard<std::mutex> lock(parked_mutex);
    std::string what = fmt::format("{} #{}", kind, collectives++);
    if (!collective_failure.empty()) {
      detail::raise<TransportError>("{}: {} refused: an earlier collective failed: {}", who(), what,
                                    collective_failure);
    }
    return what;
  }
};

namespace detail {
namespace {

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<MpiTransport::Impl> impl, std::shared_ptr<Pending> pending, bool is_recv,
          P2POptions options)
      : impl_(std::move(impl)), p_(std::move(pending)), is_recv_(is_recv), options_(std::move(options)) {}

  ~MpiWork() override {
    // Only reached unfinished after a timeout was thrown or when the caller dropped the Work (a contract
    // violation for sends): cancel and park rather than free buffers MPI may still use.
    if (!finished_ && !parked_) {
      try {
        impl_->park(p_);
      } catch (...) {
      }
    }
  }

  void wait(Duration timeout) override {
    if (finished_) return;
    const auto deadline = deadline_after(timeout);
    Backoff backoff(kWaitPollCap);
    while (!impl_->test(*p_)) {
      if (Clock::now() >= deadline) {
        parked_ = true;
        impl_->park(p_);
        raise<TimeoutError>("{}: timed out after {} ms waiting for {} {} rank {}", impl_->who(),
                            timeout.count(), describe_op(options_), is_recv_ ? "from" : "to", options_.peer);
      }
      backoff.pause();
    }
    finish();
  }

  bool is_completed() override {
    if (finished_) return true;
    if (!impl_->test(*p_)) return false;
    finish();
    return true;
  }

 private:
  void finish() {
    finished_ = true;
    const std::string me = impl_->who();
    const int peer = options_.peer;
    const std::string op = describe_op(options_);
    const char* dir = is_recv_ ? "from" : "to";
    if (p_->error[0] != MPI_SUCCESS) {
      raise<TransportError>("{}: {} {} rank {}: header transfer failed: {}", me, op, dir, peer,
                            mpi_error_string(p_->error[0]));
    }
    if (is_recv_) {
      const WireHeader& h = p_->header;
      int header_bytes = 0;
      {
        auto lock = impl_->serialize();
        MPI_Get_count(&p_->status[0], MPI_BYTE, &header_bytes);
      }
      TWOBP_CHECK(header_bytes == static_cast<int>(sizeof(WireHeader)) && h.magic == kHeaderMagic &&
                      h.sender == peer,
                  TransportError, "{}: {} from rank {}: received a malformed header ({} bytes)", me, op, peer,
                  header_bytes);
      TWOBP_CHECK(h.tag == options_.tag, TransportError,
                  "{}: {} from rank {}: received the message of tag {} instead of tag {}: both fold to MPI "
                  "tag {} (MPI_TAG_UB allows {} distinct tags); keep the tags in flight between two ranks "
                  "distinct modulo that",
                  me, op, peer, h.tag, options_.tag, impl_->fold(options_.tag), impl_->tag_modulus);
      const at::Tensor& buffer = p_->tensor;
      const bool same_shape = h.ndim == buffer.dim() &&
                              std::equal(buffer.sizes().begin(), buffer.sizes().end(), h.dims);
      TWOBP_CHECK(same_shape && h.dtype == static_cast<std::int32_t>(buffer.scalar_type()), UsageError,
                  "{}: {} from rank {}: expected {} but rank {} sent {}", me, op, peer,
                  describe_tensor(buffer), peer, shape_of(h));
    }
    if (p_->error[1] != MPI_SUCCESS) {
      raise<TransportError>("{}: {} {} rank {}: payload transfer failed: {}", me, op, dir, peer,
                            mpi_error_string(p_->error[1]));
    }
    if (is_recv_) {
      int bytes = 0;
      {
        auto lock = impl_->serialize();
        MPI_Get_count(&p_->status[1], MPI_BYTE, &bytes);
      }
      TWOBP_CHECK(static_cast<std::int64_t>(bytes) == static_cast<std::int64_t>(p_->tensor.nbytes()),
                  TransportError, "{}: {} from rank {}: received {} payload bytes, expected {}", me, op, peer,
                  bytes, p_->tensor.nbytes());
    }
  }

  std::shared_ptr<MpiTransport::Impl> impl_;
  std::shared_ptr<Pending> p_;
  bool is_recv_;
  P2POptions options_;
  bool finished_ = false;
  bool parked_ = false;
};

void check_cpu_message(const char* what, const std::string& rank, const at::Tensor& t, const P2POptions& options) {
  TWOBP_CHECK(t.is_cpu(), UsageError, "{}: {} {}: MpiTransport moves CPU tensors, got one on {}", rank, what,
              describe_op(options), t.device().str());
  TWOBP_CHECK(t.dim() <= kMaxDims, UsageError, "{}: {} {}: tensors of at most {} dimensions, got {}", rank,
              what, describe_op(options), kMaxDims, describe_tensor(t));
  TWOBP_CHECK(t.nbytes() <= static_cast<std::size_t>(INT_MAX), UsageError,
              "{}: {} {}: {} is {} bytes; MpiTransport messages are limited to {} bytes", rank, what,
              describe_op(options), describe_tensor(t), t.nbytes(), INT_MAX);
}

}  // namespace
}  // namespace detail

void MpiTransport::Impl::adopt(MPI_Comm c, bool thread_multiple) {
  comm = c;
  multiple = thread_multiple;
  TWOBP_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  TWOBP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  TWOBP_MPI_CHECK(MPI_Comm_size(comm, &world));
  void* attr = nullptr;
  int flag = 0;
  TWOBP_MPI_CHECK(MPI_Comm_get_attr(comm, MPI_TAG_UB, &attr, &flag));
  const std::int64_t tag_ub = flag ? *static_cast<int*>(attr) : 32767;  // 32767: the minimum MPI guarantees
  tag_modulus = (tag_ub + 1) / 2;  // tags 2f and 2f+1 with f < modulus are both <= tag_ub
  if (multiple) progress = std::make_unique<detail::ProgressThread>(comm);
  if (multiple) board = std::make_shared<detail::MpiStatusBoard>(comm, rank, world);  // collective (a dup)
}

MpiTransport::MpiTransport(const MpiEnvironment& env) : impl_(std::make_shared<Impl>()) {
  // A private communicator: our tags cannot collide with the application's own MPI traffic, and errors on it
  // are returned to us (MPI_ERRORS_RETURN) instead of killing the job.
  MPI_Comm comm = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (rc != MPI_SUCCESS) detail::raise_mpi_error(rc, "MPI_Comm_dup(MPI_COMM_WORLD)", __FILE__, __LINE__);
  impl_->adopt(comm, env.thread_multiple());
}

MpiTransport::MpiTransport(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

MpiTransport::~MpiTransport() {
  // The board may outlive us (an executor holds it): its watcher must not call MPI after MPI_Finalize.
  if (impl_->board) impl_->board->stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // the environment died first; nothing can be freed any more
  // Give parked operations a moment (cancelled receives complete at once); whatever is still active keeps
  // its buffers alive forever rather than have MPI touch freed memory.
  const auto deadline = Clock::now() + Duration(200);
  detail::Backoff backoff;
  while (Clock::now() < deadline) {
    impl_->reap();
    std::lock_guard<std::mutex> lock(impl_->parked_mutex);
    if (impl_->parked.empty()) break;
    backoff.pause();
  }
  {
    std::lock_guard<std::mutex> lock(impl_->parked_mutex);
    if (!impl_->parked.empty()) {
      new std::vector<std::shared_ptr<detail::Pending>>(std::move(impl_->parked));  // intentional leak
    }
  }
  impl_->progress.reset();  // joins the thread before its communicator goes away
  // MPI_Comm_free only marks the communicator; operations still pending on it complete normally.
  MPI_Comm_free(&impl_->comm);
}

int MpiTransport::rank() const { return impl_->rank; }
int MpiTransport::world_size() const { return impl_->world; }

std::unique_ptr<Work> MpiTransport::isend(const at::Tensor& tensor, const P2POptions& options) {
  detail::check_p2p_args("isend", impl_->rank, impl_->world, tensor, options);
  detail::check_cpu_message("isend", impl_->who(), tensor, options);
  impl_->reap();
  auto p = std::make_shared<detail::Pending>();
  p->tensor = tensor;  // keeps the storage alive while MPI reads it
  p->progress_token = impl_->progress_token();
  auto& h = p->header;
  h.magic = detail::kHeaderMagic;
  h.sender = impl_->rank;
  h.dtype = static_cast<std::int32_t>(tensor.scalar_type());
  h.ndim = static_cast<std::int32_t>(tensor.dim());
  h.tag = options.tag;
  h.numel = tensor.numel();
  for (int d = 0; d < tensor.dim(); ++d) h.dims[d] = tensor.size(d);
  const int tag = impl_->fold(options.tag);
  {
    auto lock = impl_->serialize();
    int rc = MPI_Isend(&p->header, sizeof(detail::WireHeader), MPI_BYTE, options.peer, 2 * tag, impl_->comm,
                       &p->requests[0]);
    if (rc == MPI_SUCCESS) {
      p->done[0] = false;
      rc = MPI_Isend(tensor.data_ptr(), static_cast<int>(tensor.nbytes()), MPI_BYTE, options.peer, 2 * tag + 1,
                     impl_->comm, &p->requests[1]);
      if (rc == MPI_SUCCESS) p->done[1] = false;
    }
    if (rc != MPI_SUCCESS) {
      lock = {};
      impl_->park(p);
      detail::raise<TransportError>("{}: isend {} to rank {}: MPI_Isend failed at {}:{}: {}", impl_->who(),
                                    detail::describe_op(options), options.peer, __FILE__, __LINE__,
                                    detail::mpi_error_string(rc));
    }
  }
  return std::make_unique<detail::MpiWork>(impl_, std::move(p), false, options);
}

std::unique_ptr<Work> MpiTransport::irecv(at::Tensor& buffer, const P2POptions& options) {
  detail::check_p2p_args("irecv", impl_->rank, impl_->world, buffer, options);
  detail::check_cpu_message("irecv", impl_->who(), buffer, options);
  impl_->reap();
  auto p = std::make_shared<detail::Pending>();
  p->tensor = buffer;
  p->progress_token = impl_->progress_token();
  const int tag = impl_->fold(options.tag);
  {
    auto lock = impl_->serialize();
    // Both receives are posted now, the payload straight into the caller's buffer: a larger message fails
    // with MPI_ERR_TRUNCATE, which finish() explains with the header's shape.
    int rc = MPI_Irecv(&p->header, sizeof(detail::WireHeader), MPI_BYTE, options.peer, 2 * tag, impl_->comm,
                       &p->requests[0]);
    if (rc == MPI_SUCCESS) {
      p->done[0] = false;
      rc = MPI_Irecv(buffer.data_ptr(), static_cast<int>(buffer.nbytes()), MPI_BYTE, options.peer, 2 * tag + 1,
                     impl_->comm, &p->requests[1]);
      if (rc == MPI_SUCCESS) p->done[1] = false;
    }
    if (rc != MPI_SUCCESS) {
      lock = {};
      impl_->park(p);
      detail::raise<TransportError>("{}: irecv {} from rank {}: MPI_Irecv failed at {}:{}: {}", impl_->who(),
                                    detail::describe_op(options), options.peer, __FILE__, __LINE__,
                                    detail::mpi_error_string(rc));
    }
  }
  return std::make_unique<detail::MpiWork>(impl_, std::move(p), true, options);
}

namespace detail {
namespace {

// A started MPI_Iallreduce, MPI_Ireduce_scatter or MPI_Iallgatherv. wait() polls it like every collective (a timeout
// parks it and refuses later collectives) and copies a half/bfloat16 result, reduced in float32, into the caller's
// tensor.
class MpiCollectiveWork final : public Work {
 public:
  MpiCollectiveWork(std::shared_ptr<MpiTransport::Impl> impl, std::shared_ptr<Pending> pending, at::Tensor target,
                    std::string what)
      : impl_(std::move(impl)), p_(std::move(pending)), target_(std::move(target)), what_(std::move(what)) {}

  ~MpiCollectiveWork() override {
    // Dropped unfinished (the step failed): MPI may still write into the buffer, so keep it parked.
    if (!finished_) {
      try {
        impl_->park(p_);
      } catch (...) {
      }
    }
  }

  void wait(Duration timeout) override {
    if (finished_) return;
    finished_ = true;  // wait_collective parks the operation itself on a timeout
    impl_->wait_collective(p_, what_, timeout);
    if (!p_->tensor.is_same(target_)) target_.copy_(p_->tensor);
  }

  bool is_completed() override {
    if (finished_) return true;
    if (!impl_->test(*p_)) return false;
    wait(Duration(0));
    return true;
  }

 private:
  std::shared_ptr<MpiTransport::Impl> impl_;
  std::shared_ptr<Pending> p_;
  at::Tensor target_;
  std::string what_;
  bool finished_ = false;
};

}  // namespace
}  // namespace detail

void MpiTransport::all_reduce_sum(at::Tensor& tensor, Duration timeout) {
  all_reduce_sum_async(tensor, timeout)->wait(timeout);
}

std::unique_ptr<Work> MpiTransport::all_reduce_sum_async(at::Tensor& tensor, Duration timeout) {
  const std::string what = impl_->begin_collective("all_reduce_sum");
  TWOBP_CHECK(tensor.defined() && tensor.is_cpu(), UsageError,
              "{}: {}: MpiTransport reduces defined CPU tensors", impl_->who(), what);
  MPI_Datatype type = MPI_DATATYPE_NULL;
  at::Tensor work = tensor;
  if (!detail::mpi_type_of(tensor.scalar_type(), &type)) {
    // MPI has no half/bfloat16 sum: reduce in float32 (more accurate anyway) and round once at the end.
    TWOBP_CHECK(tensor.scalar_type() == c10::kHalf || tensor.scalar_type() == c10::kBFloat16, UsageError,
                "{}: {}: dtype {} cannot be summed over MPI", impl_->who(), what,
                c10::toString(tensor.scalar_type()));
    work = tensor.to(c10::kFloat);
    type = MPI_FLOAT;
  }
  if (!work.is_contiguous()) work = work.contiguous();
  TWOBP_CHECK(work.numel() <= INT_MAX, UsageError, "{}: {}: at most {} elements", impl_->who(), what, INT_MAX);
  auto p = std::make_shared<detail::Pending>();
  p->tensor = work;
  // The progress thread keeps the reduction moving while this rank computes (MPI progresses only inside calls).
  p->progress_token = impl_->progress_token();
  {
    auto lock = impl_->serialize();
    TWOBP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, work.data_ptr(), static_cast<int>(work.numel()), type, MPI_SUM,
                                   impl_->comm, &p->requests[0]));
    p->done[0] = false;
  }
  return std::make_unique<detail::MpiCollectiveWork>(impl_, std::move(p), tensor, what);
}

namespace {

// The per-rank element counts of a flat buffer of n elements (shard_range), times `scale`, and their offsets; UsageError
// unless every number fits MPI's int.
void shard_counts(const std::string& who, const std::string& what, std::int64_t n, int world, std::int64_t scale,
                  std::vector<int>* counts, std::vector<int>* displacements) {
  TWOBP_CHECK(n <= INT_MAX / scale, UsageError, "{}: {}: at most {} {} in all, got {} elements of {} bytes", who,
              what, INT_MAX, scale == 1 ? "elements" : "bytes", n, scale);
  for (int r = 0; r < world; ++r) {
    const ShardRange range = shard_range(n, world, r);
    counts->push_back(static_cast<int>(range.size() * scale));
    displacements->push_back(static_cast<int>(range.begin * scale));
  }
}

}  // namespace

std::unique_ptr<Work> MpiTransport::reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                             Duration timeout) {
  auto& im = *impl_;
  detail::check_reduce_scatter_args(im.who(), im.world, im.rank, input, output);
  TWOBP_CHECK(input.is_cpu(), UsageError, "{}: reduce_scatter_sum: MpiTransport reduces CPU tensors, got one on {}",
              im.who(), input.device().str());
  MPI_Datatype type = MPI_DATATYPE_NULL;
  const bool via_float = !detail::mpi_type_of(input.scalar_type(), &type);
  // MPI has no half/bfloat16 sum: reduce in float32 (more accurate anyway) and round once at the end.
  TWOBP_CHECK(!via_float || input.scalar_type() == c10::kHalf || input.scalar_type() == c10::kBFloat16, UsageError,
              "{}: reduce_scatter_sum: dtype {} cannot be summed over MPI", im.who(),
              c10::toString(input.scalar_type()));
  if (!im.checked_reduce_scatter) {
    detail::check_ranks_agree(*this, im.who(), "reduce_scatter_sum", input.numel(), input.scalar_type(), timeout);
    im.checked_reduce_scatter = true;
  }
  auto p = std::make_shared<detail::Pending>();
  shard_counts(im.who(), "reduce_scatter_sum", input.numel(), im.world, 1, &p->counts, &p->displacements);
  const std::string what = im.begin_collective("reduce_scatter_sum");
  p->input = via_float ? input.to(c10::kFloat) : input;
  p->tensor = via_float ? at::empty({output.numel()}, at::kFloat) : output;
  if (via_float) type = MPI_FLOAT;
  p->progress_token = im.progress_token();
  {
    auto lock = im.serialize();
    TWOBP_MPI_CHECK(MPI_Ireduce_scatter(p->input.data_ptr(), p->tensor.data_ptr(), p->counts.data(), type, MPI_SUM,
                                        im.comm, &p->requests[0]));
    p->done[0] = false;
  }
  return std::make_unique<detail::MpiCollectiveWork>(impl_, std::move(p), output, what);
}

void MpiTransport::reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) {
  reduce_scatter_sum_async(input, output, timeout)->wait(timeout);
}

std::unique_ptr<Work> MpiTransport::all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  auto& im = *impl_;
  detail::check_all_gather_args(im.who(), im.world, im.rank, shard, output);
  TWOBP_CHECK(shard.is_cpu(), UsageError, "{}: all_gather: MpiTransport gathers CPU tensors, got one on {}", im.who(),
              shard.device().str());
  if (!im.checked_all_gather) {
    detail::check_ranks_agree(*this, im.who(), "all_gather", output.numel(), output.scalar_type(), timeout);
    im.checked_all_gather = true;
  }
  auto p = std::make_shared<detail::Pending>();
  // Bytes, so that every dtype travels.
  shard_counts(im.who(), "all_gather", output.numel(), im.world, static_cast<std::int64_t>(output.element_size()),
               &p->counts, &p->displacements);
  const std::string what = im.begin_collective("all_gather");
  p->input = shard;
  p->tensor = output;
  p->progress_token = im.progress_token();
  {
    auto lock = im.serialize();
    TWOBP_MPI_CHECK(MPI_Iallgatherv(shard.data_ptr(), p->counts[static_cast<std::size_t>(im.rank)], MPI_BYTE,
                                    output.data_ptr(), p->counts.data(), p->displacements.data(), MPI_BYTE, im.comm,
                                    &p->requests[0]));
    p->done[0] = false;
  }
  return std::make_unique<detail::MpiCollectiveWork>(impl_, std::move(p), output, what);
}

void MpiTransport::all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  all_gather_async(shard, output, timeout)->wait(timeout);
}

void MpiTransport::barrier(Duration timeout) {
  const std::string what = impl_->begin_collective("barrier");
  auto p = std::make_shared<detail::Pending>();
  {
    auto lock = impl_->serialize();
    TWOBP_MPI_CHECK(MPI_Ibarrier(impl_->comm, &p->requests[0]));
    p->done[0] = false;
  }
  impl_->wait_collective(std::move(p), what, timeout);
}

void MpiTransport::broadcast(at::Tensor& tensor, int root, Duration timeout) {
  const std::string what = impl_->begin_collective(fmt::format("broadcast from rank {}", root).c_str());
  TWOBP_CHECK(tensor.defined() && tensor.is_cpu(), UsageError, "{}: {}: MpiTransport broadcasts defined CPU tensors",
              impl_->who(), what);
  TWOBP_CHECK(root >= 0 && root < impl_->world, UsageError, "{}: {}: no such rank (world size {})", impl_->who(),
              what, impl_->world);
  at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  // Bytes, so that every dtype travels; one MPI count is an int.
  TWOBP_CHECK(work.nbytes() <= static_cast<std::size_t>(INT_MAX), UsageError, "{}: {}: at most {} bytes, got {}",
              impl_->who(), what, INT_MAX, work.nbytes());
  auto p = std::make_shared<detail::Pending>();
  p->tensor = work;
  {
    auto lock = impl_->serialize();
    TWOBP_MPI_CHECK(MPI_Ibcast(work.data_ptr(), static_cast<int>(work.nbytes()), MPI_BYTE, root, impl_->comm,
                               &p->requests[0]));
    p->done[0] = false;
  }
  impl_->wait_collective(std::move(p), what, timeout);
  if (!work.is_same(tensor)) tensor.copy_(work);
}

std::unique_ptr<Transport> MpiTransport::split(int color, int key, Duration timeout) {
  // WHY gather first: MPI_Comm_split blocks without a timeout. After this (timed) collective every rank is known
  // to have entered split, so the MPI_Comm_split below cannot wait for a rank that never comes.
  const auto colors = detail::gather_split_colors(*this, color, key, timeout);
  MPI_Comm child = MPI_COMM_NULL;
  {
    auto lock = impl_->serialize();
    const int rc = MPI_Comm_split(impl_->comm, color < 0 ? MPI_UNDEFINED : color, key, &child);
    if (rc != MPI_SUCCESS) {
      detail::raise<TransportError>("{}: split (color {}): MPI_Comm_split failed: {}", impl_->who(), color,
                                    detail::mpi_error_string(rc));
    }
  }
  if (color < 0 || child == MPI_COMM_NULL) return nullptr;
  auto impl = std::make_shared<Impl>();
  impl->adopt(child, impl_->multiple);
  // MPI orders the group by (key, parent rank) too; check that it agrees with what every rank computed.
  const std::vector<int> members = detail::split_members(colors, color);
  TWOBP_CHECK(static_cast<int>(members.size()) == impl->world && members[impl->rank] == impl_->rank, TransportError,
              "{}: split (color {}): MPI_Comm_split made rank {} of {}, expected rank {} of {}", impl_->who(), color,
              impl->rank, impl->world,
              std::find(members.begin(), members.end(), impl_->rank) - members.begin(), members.size());
  impl->name = detail::group_member_name(impl->rank, color, impl_->who());
  return std::unique_ptr<Transport>(new MpiTransport(std::move(impl)));
}

std::shared_ptr<StatusBoard> MpiTransport::status_board() const { return impl_->board; }

void MpiTransport::abort(const std::string& reason) {
  // MPI has no way to fail only the peers' pending operations: the whole job is torn down.
  std::fprintf(stderr, "twobp: rank %d aborts the MPI job: %s\n", impl_->rank, reason.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  detail::raise<TransportError>("{}: MPI_Abort returned (reason was: {})", impl_->who(), reason);
}

}  // namespace twobp
