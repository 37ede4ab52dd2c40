#pragma once
// What a rank is doing, for the hang report (twobp/runtime/hang_report.h): set at every action and wait (a mutex
// and a few stores; nothing is formatted until a report asks), read through the transport's status board.

#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
    peers_.clear();
    since_ = Clock::now();
    detail_ = std::move(detail);
  }
  /// The rank now waits in a collective: `what` (e.g. "the data-parallel gradient reduction") with the other ranks
  /// `world_peers` (world ranks: they need no mapping).
  void note_collective(std::string what, std::vector<int> world_peers) {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = RankStatus::State::kWaiting;
    action_.reset();
    peer_ = -1;
    peers_ = std::move(world_peers);
    since_ = Clock::now();
    detail_ = std::move(what);
  }
  /// The run (step) number the rank is in.
  void set_run(std::int64_t run) {
    std::lock_guard<std::mutex> lock(mutex_);
    run_ = run;
  }
  /// The encoded RankStatus (encode()), as the board passes it on; `world_of` maps the group rank of a peer whose
  /// message it waits for to its world rank (Transport::world_rank_of, index = group rank).
  std::string text(const std::vector<int>& world_of) const {
    std::lock_guard<std::mutex> lock(mutex_);
    RankStatus s;
    s.state = state_;
    s.action = action_ ? describe(*action_) : std::string();
    s.peer = peer_ >= 0 && peer_ < static_cast<int>(world_of.size()) ? world_of[static_cast<std::size_t>(peer_)]
                                                                        : peer_;
    s.peers = peers_;
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
  std::vector<int> peers_;  // world ranks
  std::int64_t run_ = -1;
  Clock::time_point since_ = Clock::now();
  std::string detail_;
};

}  // namespace twobp::detail
