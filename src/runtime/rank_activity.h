#pragma once
// What a rank is doing, for the hang report (twobp/runtime/hang_report.h): set at every action and wait (a mutex
// and a few stores; nothing is formatted until a report asks), read through the transport's status board.

#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "twobp/runtime/hang_report.h"
#include "twobp/schedule/action.h"
#include "twobp/transport/transport.h"

namespace twobp::detail {

/// Shared with the status board's reader, which may outlive the executor (the board keeps the reader of the last
/// executor that ran on this rank), so the action is kept by value. Thread-safe.
class RankActivity {
 public:
  /// The rank is now in `state` at `action` (null: between actions), waiting for `peer` (-1: none).
  void note(RankStatus::State state, const Action* action, int peer = -1, std::string detail = {}) {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = state;
    action_ = action ? std::optional<Action>(*action) : std::nullopt;
    peer_ = peer;
    since_ = Clock::now();
    detail_ = std::move(detail);
  }
  /// The run (step) number the rank is in.
  void set_run(std::int64_t run) {
    std::lock_guard<std::mutex> lock(mutex_);
    run_ = run;
  }
  /// The encoded RankStatus (encode()), as the board passes it on.
  std::string text() const {
    std::lock_guard<std::mutex> lock(mutex_);
    RankStatus s;
    s.state = state_;
    s.action = action_ ? describe(*action_) : std::string();
    s.peer = peer_;
    s.run = run_;
    s.seconds = std::chrono::duration<double>(Clock::now() - since_).count();
    s.detail = detail_;
    return encode(s);
  }

 private:
  mutable std::mutex mutex_;
  RankStatus::State state_ = RankStatus::State::kOutsideStep;
  std::optional<Action> action_;
  int peer_ = -1;
  std::int64_t run_ = -1;
  Clock::time_point since_ = Clock::now();
  std::string detail_;
};

}  // namespace twobp::detail
