#pragma once
// Memory records and the byte bound of memory-bounded 2BP (ExecutorOptions::record_memory, memory_limit_bytes):
// the rank's tensor memory around each action, what each kind of action added, and whether the oldest deferred W
// must run before the next action so that it fits. Private to the runtime; the Executor owns one and keeps the
// deferred W's themselves (it runs them).

#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <set>
#include <tuple>

#include "twobp/runtime/executor.h"
#include "twobp/schedule/action.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

namespace twobp::detail {

class MemoryBound {
 public:
  /// Checks that the rank's memory can be measured where options ask for it (UsageError naming `rank` otherwise).
  MemoryBound(const ExecutorOptions& options, const Transport& transport, int rank);

  /// Whether memory is recorded around every action (record_memory, or a byte limit).
  bool records() const { return records_; }
  /// Whether the memory is bounded in bytes (memory_limit_bytes > 0).
  bool limited() const { return limit_ > 0; }

  /// One action's measurement: begin() before it runs, end() after.
  struct Mark {
    std::tuple<ActionType, int, bool> kind;
    int64_t before = -1;
  };
  /// `weights_started`: the stages whose first W or B of the step ran (it allocates their gradients).
  Mark begin(ActionType type, int stage, const std::set<int>& weights_started) const;
  /// Fills `event`'s memory fields and learns what the action's kind adds.
  void end(const Mark& mark, TraceEvent& event);

  /// Bounded in bytes: what the next action is expected to need (taken before any W runs early for it).
  struct Need {
    int64_t rise = 0;   // above the memory held before it, while it runs
    int64_t added = 0;  // what it leaves behind (at least 0)
  };
  Need need_of(const Action& next, const std::set<int>& weights_started) const;
  /// Whether the oldest deferred W, of `oldest_stage`, should run before the action that needs `next`.
  bool run_oldest_first(const Need& next, int oldest_stage, const std::set<int>& weights_started) const;

 private:
  // An action's kind for its expected rise: (type, stage, whether it is the stage's first W or B of the step,
  // which allocates gradients reset by zero_grad()).
  using Kind = std::tuple<ActionType, int, bool>;
  static Kind kind_of(ActionType type, int stage, const std::set<int>& weights_started);
  static int64_t expected(const std::map<Kind, int64_t>& table, const Kind& kind);

  int64_t limit_;
  bool records_;
  c10::Device device_;
  // Per kind, the most tensor memory one such action added while it ran (rise_), and by its end (added_).
  std::map<Kind, int64_t> rise_, added_;
};

}  // namespace twobp::detail
