#pragma once
// The watchdog of waits the host does not block on (NcclOptions::stream_waits): a receive's completion is waited
// on the consumer's CUDA stream, so no host call times out when the peer never sends. A thread of its own polls
// every such wait until it completed; the first that outlives its deadline (or whose poll fails) is recorded as the
// transport's error and the abort callback runs -- once -- so that the communicator's kernels stop occupying the
// GPU (as PyTorch's ProcessGroupNCCL watchdog does). The owner raises the recorded error from its next call
// (check()), which is where the caller's timeout handling -- the hang report, the job-wide abort -- runs.
//
// Knows nothing of CUDA or NCCL: a wait is a non-blocking poll function, so the component is tested on the CPU
// with fake works (tests/transport/local_transport_test.cpp, Watchdog.*).

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "twobp/transport/transport.h"

namespace twobp::detail {

class Watchdog {
 public:
  /// True once the watched operation completed, false while it is pending; throws when it failed. Called on the
  /// watchdog's thread, at most once at a time per watchdog; it must not block (a CUDA event query, an NCCL
  /// asynchronous-error query) and must stay callable until it returned true, threw, or the watchdog is destroyed.
  using Poll = std::function<bool()>;
  /// Called once, on the watchdog's thread, after the first failure was recorded, with its text. Its own
  /// exceptions are swallowed (there is nobody to hand them to); it must not call the watchdog.
  using Abort = std::function<void(const std::string& reason)>;

  /// `rank` prefixes every error; `what_aborts` says in it what the abort did ("aborted the NCCL communicators").
  /// `interval`: how often pending waits are polled (the thread sleeps while none is pending).
  Watchdog(int rank, Abort abort, std::string what_aborts,
           std::chrono::microseconds interval = std::chrono::microseconds(1000));
  /// Stops the thread and joins it (within one interval plus a poll in progress); pending waits are dropped, not
  /// aborted. Never throws.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Watches one wait from now until `timeout`: `what` names it in the error ("RECV_F stage 1 micro-batch 2
  /// (tag 9) from rank 0"). After a failure nothing more is watched: throws the recorded error instead.
  void watch(std::string what, Duration timeout, Poll poll);

  /// Throws the first failure -- TimeoutError "rank R: timed out after T ms waiting for WHAT ...", or
  /// TransportError when a poll threw -- once one was recorded; a new exception at every call. Cheap.
  void check() const;
  bool failed() const;
  /// Waits being watched (not completed, not failed).
  std::size_t pending() const;
  /// Blocks until nothing is pending (true), a failure was recorded or `timeout` passed (false).
  bool wait_until_idle(Duration timeout) const;

 private:
  struct Entry {
    std::string what;
    Duration timeout;
    Clock::time_point deadline;
    Poll poll;
  };
  struct Failure {
    bool timed_out = false;
    std::string text;
  };

  void loop();
  // One pass over `entries`, outside the mutex: the index of the first failed entry and its failure, and every
  // completed one marked in `done`.
  std::optional<Failure> poll_all(const std::vector<std::shared_ptr<Entry>>& entries, std::vector<bool>& done) const;

  const int rank_;
  const Abort abort_;
  const std::string what_aborts_;
  const std::chrono::microseconds interval_;
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;  // new entries, stop, idle, failure
  std::vector<std::shared_ptr<Entry>> entries_;
  std::optional<Failure> failure_;
  bool stop_ = false;
  std::thread thread_;  // last: started when everything above is constructed
};

}  // namespace twobp::detail
