#include "runtime/memory_bound.h"

#include <algorithm>
#include <string>

#include "twobp/metrics/memory.h"
#include "util/check.h"

namespace twobp::detail {

MemoryBound::MemoryBound(const ExecutorOptions& options, const Transport& transport, int rank)
    : limit_(options.memory_limit_bytes),
      records_(options.record_memory || options.memory_limit_bytes > 0),
      device_(options.memory_device.value_or(transport.device())) {
  TWOBP_CHECK(limit_ >= 0, UsageError, "rank {}: the memory limit must be >= 0 bytes (0: no limit), got {}", rank,
              limit_);
  if (!records_) return;
  // A device's allocator statistics are per process: rank threads on one device would read (and reset the peak of)
  // each other's bytes. The CPU counter keeps an account per rank thread instead.
  const bool shared = transport.ranks_share_process() && !device_.is_cpu() &&
                      (device_ != transport.device() || transport.ranks_sharing_device() > 1);
  TWOBP_CHECK(!shared, UsageError,
              "rank {}: recording memory or bounding it in bytes on {}: {} rank threads of this process compute on "
              "that device, and its allocator statistics are the whole process's; run one rank per process (mpirun, "
              "torchrun), give each rank thread a device of its own (LocalOptions::devices), or turn record_memory "
              "and memory_limit_bytes off",
              rank, device_.str(),
              device_ != transport.device() ? std::string("several")
                                            : std::to_string(transport.ranks_sharing_device()));
  TWOBP_CHECK(memory::measurable(device_), UsageError,
              "rank {}: recording memory or bounding it in bytes needs the tensor memory of {}: {}", rank,
              device_.str(),
              device_.is_cpu()
                  ? "call twobp::memory::count_cpu_allocations() at the start of main(), before building the model"
                  : "its allocator keeps no statistics");
}

MemoryBound::Kind MemoryBound::kind_of(ActionType type, int stage, const std::set<int>& weights_started) {
  const bool weights = makes_weight_grads(type);
  return {type, stage, weights && weights_started.count(stage) == 0};
}

// The most an action of this kind added (`table`: while it ran, or by its end) in this step or an earlier one;
// for a kind not seen yet, the same type and stage with the other gradient flag (a W not seen as a later W of its
// stage yet is bounded by that stage's first W, which also allocated the gradients), else the most of any kind.
int64_t MemoryBound::expected(const std::map<Kind, int64_t>& table, const Kind& kind) {
  if (auto it = table.find(kind); it != table.end()) return it->second;
  const auto& [type, stage, first] = kind;
  if (auto it = table.find({type, stage, !first}); it != table.end()) return it->second;
  int64_t most = 0;
  for (const auto& [k, v] : table) most = std::max(most, v);
  return most;
}

MemoryBound::Mark MemoryBound::begin(ActionType type, int stage, const std::set<int>& weights_started) const {
  Mark mark{kind_of(type, stage, weights_started), -1};
  if (records_) {
    memory::reset_peak(device_);
    mark.before = memory::allocated(device_).current;
  }
  return mark;
}

void MemoryBound::end(const Mark& mark, TraceEvent& event) {
  if (!records_) return;
  const memory::Allocated now = memory::allocated(device_);
  event.memory_before = mark.before;
  event.memory_after = now.current;
  event.memory_peak = now.peak;
  int64_t& rise = rise_[mark.kind];
  rise = std::max(rise, now.peak - mark.before);
  // What an action leaves behind may be negative (it can free more than it allocates), so no 0 default here.
  auto [added, fresh] = added_.try_emplace(mark.kind, now.current - mark.before);
  if (!fresh) added->second = std::max(added->second, now.current - mark.before);
}

// Before `next`, the rank needs room for it and, after it, for its oldest deferred W -- so that the W can still
// run later, when waiting longer would have piled up more deferred work than fits. While either is expected not
// to fit, the oldest deferred W runs now, provided that it fits itself or at least rises less than `next` would
// (otherwise running it would reach as high as letting `next` run: the limit is then beyond what moving W's can
// reach).
MemoryBound::Need MemoryBound::need_of(const Action& next, const std::set<int>& weights_started) const {
  const Kind kind = kind_of(next.type, next.stage, weights_started);
  return {expected(rise_, kind), std::max<int64_t>(0, expected(added_, kind))};
}

bool MemoryBound::run_oldest_first(const Need& next, int oldest_stage, const std::set<int>& weights_started) const {
  if (limit_ <= 0) return false;
  const int64_t rise_w = expected(rise_, kind_of(ActionType::kBackwardWeight, oldest_stage, weights_started));
  const int64_t current = memory::allocated(device_).current;
  if (current + std::max(next.rise, next.added + rise_w) <= limit_) return false;
  return !(current + rise_w > limit_ && rise_w >= next.rise);
}

}  // namespace twobp::detail
