// The controllable-memory V schedules in unit slots, and their squeeze (see controllable_v.h).

#include "schedule/controllable_v.h"

#include <algorithm>
#include <functional>
#include <tuple>
#include <utility>

#include "twobp/schedule/schedule.h"
#include "util/check.h"

namespace twobp::detail {
namespace {

constexpr int kVW = 4;  // a W as an action of its own (the first pass): the n-th W of a rank follows its n-th I

using Slots = std::array<std::vector<long>, 5>;  // per kind (kVF0 .. kVI0, kVW), the slot of each action

long end_slot(const Slots& s) {
  long end = 0;
  for (const auto& list : s) {
    for (long slot : list) end = std::max(end, slot + 1);
  }
  return end;
}

// The kind in each slot of one rank (-1: free).
std::vector<int> occupancy(const Slots& s, long end) {
  std::vector<int> at(static_cast<std::size_t>(end), -1);
  for (int kind = 0; kind < static_cast<int>(s.size()); ++kind) {
    for (long slot : s[kind]) at[slot] = kind;
  }
  return at;
}

// A rank's two memory peaks in chunk activations: `live` counts from F to I, `held` from F to W (the activations
// and then the state a W needs). W's are the kVW actions where there are any, else each free slot runs one.
struct Peaks {
  int live = 0;
  int held = 0;
  bool within(const Peaks& limit) const { return live <= limit.live && held <= limit.held; }
};

Peaks peaks(const Slots& s) {
  const bool implicit_w = s[kVW].empty();
  const std::vector<int> at = occupancy(s, end_slot(s));
  Peaks out;
  int live = 0, held = 0, pending = 0;
  for (int kind : at) {
    if (kind == kVF0 || kind == kVF1) {
      ++live;
      ++held;
    } else if (kind == kVI1 || kind == kVI0) {
      --live;
      ++pending;
    } else if (kind == kVW || (kind < 0 && implicit_w && pending > 0)) {
      --pending;
      --held;
    }
    out.live = std::max(out.live, live);
    out.held = std::max(out.held, held);
  }
  return out;
}

class Squeezer {
 public:
  explicit Squeezer(std::vector<Slots> plan) : plan_(std::move(plan)), p_(static_cast<int>(plan_.size())) {}

  // One pass over the actions in slot order (ties: rank, then kind). The limits are the caller's (the peaks
  // before any pass), so that no pass compounds another's growth.
  void pass(bool warm_up_too, const Peaks& limit) {
    const int kinds = plan_[0][kVW].empty() ? 4 : 5;
    const Key warm_end{plan_[0][kVI0][0], 0, kVI0};
    const Key steady_end = std::max(warm_end, Key{plan_[0][kVF0].back(), 0, kVF0});
    std::vector<std::vector<int>> busy(p_);
    for (int r = 0; r < p_; ++r) busy[r] = occupancy(plan_[r], end_slot(plan_[r]));
    std::vector<std::array<std::size_t, 5>> next(p_, std::array<std::size_t, 5>{});
    for (;;) {
      // The unprocessed action of the earliest slot.
      bool any = false;
      Key key{};
      for (int r = 0; r < p_; ++r) {
        for (int kind = 0; kind < kinds; ++kind) {
          if (next[r][kind] == plan_[r][kind].size()) continue;
          const Key k{plan_[r][kind][next[r][kind]], r, kind};
          if (!any || k < key) key = k;
          any = true;
        }
      }
      if (!any) return;
      const auto [slot, r, kind] = key;
      const int index = static_cast<int>(next[r][kind]++);
      const bool warm = key < warm_end, cool = steady_end < key;
      if (!(cool || (warm && warm_up_too))) continue;
      for (long to = inputs_done(r, kind, index) + 1; to < slot; ++to) {
        if (busy[r][to] >= 0) continue;
        plan_[r][kind][index] = to;
        if (peaks(plan_[r]).within(limit)) {
          busy[r][slot] = -1;
          busy[r][to] = kind;
          break;
        }
        plan_[r][kind][index] = slot;
      }
    }
  }

  std::vector<Slots>& plan() { return plan_; }

 private:
  using Key = std::tuple<long, int, int>;  // slot, rank, kind

  // The latest slot among the action's inputs: the same stage's previous micro-batch (each kind runs in
  // micro-batch order), the neighbouring stage's F or I (on the next or previous rank along the V, or this rank
  // at the V's turns), and for a W, the rank's I it follows.
  long inputs_done(int r, int kind, int index) const {
    const Slots& s = plan_[r];
    long done = index > 0 ? s[kind][index - 1] : -1;
    auto after = [&](int rank, int k) { done = std::max(done, plan_[rank][k][index]); };
    switch (kind) {
      case kVF0:
        if (r > 0) after(r - 1, kVF0);
        break;
      case kVF1:
        after(r, kVF0);
        if (r + 1 < p_) after(r + 1, kVF1);
        break;
      case kVI1:
        after(r, kVF1);
        if (r > 0) after(r - 1, kVI1);
        break;
      case kVI0:
        after(r, kVI1);
        if (r + 1 < p_) after(r + 1, kVI0);
        break;
      default: {  // kVW
        std::vector<long> inputs(s[kVI1]);
        inputs.insert(inputs.end(), s[kVI0].begin(), s[kVI0].end());
        std::nth_element(inputs.begin(), inputs.begin() + index, inputs.end());
        done = std::max(done, inputs[index]);
      }
    }
    return done;
  }

  std::vector<Slots> plan_;
  int p_;
};

// The blocks repeated for m micro-batches: `first` gives rank r's slots of micro-batch 0.
std::vector<VRankSlots> repeat_blocks(int p, int m, const std::function<std::array<long, 4>(long)>& first) {
  std::vector<VRankSlots> slots(p);
  for (int r = 0; r < p; ++r) {
    const std::array<long, 4> base = first(r);
    for (int kind = 0; kind < 4; ++kind) {
      for (int mb = 0; mb < m; ++mb) slots[r][kind].push_back(base[kind] + 6L * mb);
    }
  }
  return slots;
}

}  // namespace

std::vector<VRankSlots> v_half_blocks(int p, int m) {
  const long d = p % 2 == 0 ? 3 : 0;
  return repeat_blocks(p, m, [p = long{p}, d](long r) {
    return std::array<long, 4>{2 * r, 3 * p - r - 2, 3 * p + d + 2 * r - 1, 6 * p + d - r - 2};
  });
}

std::vector<VRankSlots> v_min_blocks(int p, int m) {
  const long d = p % 3 == 0 ? 2 : 0;
  return repeat_blocks(p, m, [p = long{p}, d](long r) {
    return std::array<long, 4>{r, 2 * p - r - 1, 2 * p + d + r, 4 * p + d - r - 1};
  });
}

std::vector<std::pair<long, int>> v_weight_slots(const VRankSlots& slots, bool trailing) {
  Slots s;
  std::copy(slots.begin(), slots.end(), s.begin());
  std::array<int, 2> pending{};  // per chunk
  std::vector<std::pair<long, int>> out;
  auto take = [&](long slot) {
    const int chunk = pending[1] > 0 ? 1 : 0;
    --pending[chunk];
    out.emplace_back(slot, chunk);
  };
  const std::vector<int> at = occupancy(s, end_slot(s));
  for (long t = 0; t < static_cast<long>(at.size()); ++t) {
    if (at[t] == kVI1) ++pending[1];
    if (at[t] == kVI0) ++pending[0];
    if (at[t] < 0 && pending[0] + pending[1] > 0) take(t);
  }
  for (long t = static_cast<long>(at.size()); trailing && pending[0] + pending[1] > 0; ++t) take(t);
  return out;
}

std::vector<VRankSlots> squeeze_v(std::vector<VRankSlots> slots) {
  if (slots.empty() || slots[0][kVF0].empty()) return slots;  // no rank or no micro-batch: nothing to move
  std::vector<Slots> plan(slots.size());
  Peaks limit;
  for (std::size_t r = 0; r < slots.size(); ++r) {
    std::copy(slots[r].begin(), slots[r].end(), plan[r].begin());
    std::vector<long> all;
    for (const auto& list : slots[r]) all.insert(all.end(), list.begin(), list.end());
    std::sort(all.begin(), all.end());
    TWOBP_CHECK(std::adjacent_find(all.begin(), all.end()) == all.end(), ScheduleError,
                "internal error: a V pattern puts two actions of rank {} in one slot", r);
    for (const auto& [slot, chunk] : v_weight_slots(slots[r], true)) plan[r][kVW].push_back(slot);
    const Peaks before = peaks(plan[r]);
    limit.live = std::max(limit.live, before.live);
    limit.held = std::max(limit.held, before.held);
  }
  Squeezer squeezer(std::move(plan));
  squeezer.pass(true, limit);
  for (Slots& s : squeezer.plan()) s[kVW].clear();
  squeezer.pass(false, limit);
  for (std::size_t r = 0; r < slots.size(); ++r) {
    std::copy_n(squeezer.plan()[r].begin(), 4, slots[r].begin());
  }
  return slots;
}

}  // namespace twobp::detail
