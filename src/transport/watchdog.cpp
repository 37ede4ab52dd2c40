// The watchdog of stream-side waits: see watchdog.h.

#include "transport/watchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "transport/common.h"
#include "twobp/error.h"
#include "util/check.h"

namespace twobp::detail {

Watchdog::Watchdog(int rank, Abort abort, std::string what_aborts, std::chrono::microseconds interval)
    : rank_(rank),
      abort_(std::move(abort)),
      what_aborts_(std::move(what_aborts)),
      interval_(std::max(interval, std::chrono::microseconds(1))),
      thread_([this] { loop(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::watch(std::string what, Duration timeout, Poll poll) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) {
      entries_.push_back(std::make_shared<Entry>(
          Entry{std::move(what), timeout, deadline_after(timeout), std::move(poll)}));
    }
  }
  check();
  changed_.notify_all();
}

void Watchdog::check() const {
  std::optional<Failure> failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure = failure_;
  }
  if (!failure) return;
  if (failure->timed_out) throw TimeoutError(failure->text);
  throw TransportError(failure->text);
}

bool Watchdog::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_.has_value();
}

std::size_t Watchdog::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

bool Watchdog::wait_until_idle(Duration timeout) const {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait_until(lock, deadline_after(timeout), [&] { return entries_.empty() || failure_ || stop_; });
  return entries_.empty() && !failure_;
}

std::optional<Watchdog::Failure> Watchdog::poll_all(const std::vector<std::shared_ptr<Entry>>& entries,
                                                    std::vector<bool>& done) const {
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const Entry& e = *entries[k];
    try {
      done[k] = e.poll();
    } catch (const std::exception& err) {
      return Failure{false, fmt::format("rank {}: {} failed while waited on the stream: {} (the watchdog {})", rank_,
                                        e.what, err.what(), what_aborts_)};
    } catch (...) {
      return Failure{false, fmt::format("rank {}: {} failed while waited on the stream (the watchdog {})", rank_,
                                        e.what, what_aborts_)};
    }
    // Polled before the deadline is compared: a wait that completed just in time is not a timeout.
    if (!done[k] && Clock::now() >= e.deadline) {
      return Failure{true, fmt::format("rank {}: timed out after {} ms waiting for {} (waited on the stream; the "
                                       "watchdog {})",
                                       rank_, e.timeout.count(), e.what, what_aborts_)};
    }
  }
  return std::nullopt;
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (entries_.empty() || failure_) {
      changed_.wait(lock, [&] { return stop_ || (!entries_.empty() && !failure_); });
      continue;
    }
    // The polls run outside the mutex: watch() and check() never wait for a poll, and the owner may hold its own
    // locks while it calls them (the abort callback takes those locks, never ours).
    const std::vector<std::shared_ptr<Entry>> snapshot = entries_;
    lock.unlock();
    std::vector<bool> done(snapshot.size(), false);
    std::optional<Failure> failure = poll_all(snapshot, done);
    lock.lock();
    if (failure) {
      // Recorded before the abort runs: a caller that sees the abort's effects (a broken channel) first finds the
      // error that names the wait.
      failure_ = std::move(failure);
      entries_.clear();
      const std::string reason = failure_->text;
      lock.unlock();
      changed_.notify_all();
      try {
        abort_(reason);
      } catch (...) {
      }
      lock.lock();
      continue;
    }
    for (std::size_t k = 0; k < snapshot.size(); ++k) {
      if (!done[k]) continue;
      entries_.erase(std::remove(entries_.begin(), entries_.end(), snapshot[k]), entries_.end());
    }
    if (entries_.empty()) changed_.notify_all();
    changed_.wait_for(lock, interval_, [&] { return stop_; });
  }
}

}  // namespace twobp::detail
