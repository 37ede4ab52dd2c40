// The controllable-memory V schedules' unit-slot plans and the paper's squeeze (src/schedule/controllable_v.h).

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <string>
#include <vector>

#include "schedule/controllable_v.h"
#include "schedule/generators.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/validate.h"

namespace twobp {
namespace {

using detail::VRankSlots;
using Blocks = std::function<std::vector<VRankSlots>(int, int)>;

struct Pattern {
  const char* name;
  Blocks blocks;
};

std::vector<Pattern> patterns() { return {{"v-half", detail::v_half_blocks}, {"v-min", detail::v_min_blocks}}; }

std::vector<int> micro_batch_counts(int p) {
  std::vector<int> out{1, p, 2 * p, 3 * p + 1, 4 * p};
  if (p > 2) out.push_back(p - 1);
  return out;
}

// A slot plan is valid when every rank runs at most one action per slot, each (rank, kind) runs its micro-batches
// in order, and each micro-batch's actions follow the V in strictly increasing slots: F of stages 0 .. 2p - 1
// (chunk 0 down the ranks, chunk 1 back up), then I of stages 2p - 1 .. 0.
std::string invalid(const std::vector<VRankSlots>& plan, int m) {
  const int p = static_cast<int>(plan.size());
  for (int r = 0; r < p; ++r) {
    std::vector<long> all;
    for (int kind = 0; kind < 4; ++kind) {
      if (static_cast<int>(plan[r][kind].size()) != m) return "rank " + std::to_string(r) + ": not m actions";
      if (!std::is_sorted(plan[r][kind].begin(), plan[r][kind].end())) return "micro-batches out of order";
      all.insert(all.end(), plan[r][kind].begin(), plan[r][kind].end());
    }
    std::sort(all.begin(), all.end());
    if (std::adjacent_find(all.begin(), all.end()) != all.end()) return "two actions in one slot";
    if (all.front() < 0) return "a negative slot";
  }
  for (int mb = 0; mb < m; ++mb) {
    std::vector<long> chain;
    for (int r = 0; r < p; ++r) chain.push_back(plan[r][detail::kVF0][mb]);
    for (int r = p - 1; r >= 0; --r) chain.push_back(plan[r][detail::kVF1][mb]);
    for (int r = 0; r < p; ++r) chain.push_back(plan[r][detail::kVI1][mb]);
    for (int r = p - 1; r >= 0; --r) chain.push_back(plan[r][detail::kVI0][mb]);
    for (std::size_t k = 1; k < chain.size(); ++k) {
      if (chain[k] <= chain[k - 1]) return "micro-batch " + std::to_string(mb) + " runs against the V";
    }
  }
  return "";
}

// The largest over ranks of the chunk activations alive from F to I (`until_w` false) or from F to W, with the W's
// where v_weight_slots puts them (trailing ones included).
int peak(const std::vector<VRankSlots>& plan, bool until_w) {
  int out = 0;
  for (const VRankSlots& s : plan) {
    std::vector<std::pair<long, int>> events;  // slot, change
    for (int kind = 0; kind < 4; ++kind) {
      const bool forward = kind == detail::kVF0 || kind == detail::kVF1;
      if (!forward && until_w) continue;
      for (long slot : s[kind]) events.emplace_back(slot, forward ? 1 : -1);
    }
    if (until_w) {
      for (const auto& [slot, chunk] : detail::v_weight_slots(s, true)) events.emplace_back(slot, -1);
    }
    std::sort(events.begin(), events.end());
    int held = 0;
    for (const auto& [slot, change] : events) out = std::max(out, held += change);
  }
  return out;
}

// The squeeze keeps a valid plan and neither memory peak grows, for every p and m tried (m below p, p, multiples
// and not), both patterns.
TEST(ControllableV, SqueezeKeepsAValidPlanAndBothMemoryPeaks) {
  for (const Pattern& pattern : patterns()) {
    for (int p = 1; p <= 9; ++p) {
      for (int m : micro_batch_counts(p)) {
        const std::string what = std::string(pattern.name) + " p=" + std::to_string(p) + " m=" + std::to_string(m);
        const auto blocks = pattern.blocks(p, m);
        ASSERT_EQ(invalid(blocks, m), "") << what << ": the blocks themselves";
        const auto squeezed = detail::squeeze_v(blocks);
        EXPECT_EQ(invalid(squeezed, m), "") << what;
        EXPECT_LE(peak(squeezed, false), peak(blocks, false)) << what << ": F to I";
        EXPECT_LE(peak(squeezed, true), peak(blocks, true)) << what << ": F to W";
      }
    }
  }
}

// What the squeeze is for: under F = I = W = 1 the 2BP form of the squeezed plan is never slower than the blocks'
// and never holds more (simulate's peak, every rank), and V-Half's is faster wherever the pipeline fills (m >= 2p,
// p >= 2): its blocks leave free slots in the warm-up and cool-down that the squeeze fills. (V-Min's blocks are
// tight where its memory bound binds; the squeeze rarely finds a move there.) The schedules the registry makes are
// the squeezed ones.
TEST(ControllableV, SqueezedTwoBpFormsAreNeverSlowerAndVHalfIsFaster) {
  for (const Pattern& pattern : patterns()) {
    for (int p = 2; p <= 8; ++p) {
      for (int m : micro_batch_counts(p)) {
        const std::string what = std::string(pattern.name) + " p=" + std::to_string(p) + " m=" + std::to_string(m);
        const ScheduleOptions o{p, m, 2, BackwardMode::kSplit};
        const Schedule blocks = detail::v_schedule_from_slots(pattern.name, o, pattern.blocks(p, m));
        const Schedule squeezed = make_schedule(pattern.name, o);
        EXPECT_EQ(squeezed.actions,
                  detail::v_schedule_from_slots(pattern.name, o, detail::squeeze_v(pattern.blocks(p, m))).actions)
            << what;
        EXPECT_NO_THROW(validate(blocks)) << what;
        const auto unit = CostModel::uniform(2 * p, 1.0, 1.0, 1.0);
        const auto before = simulate(blocks, unit), after = simulate(squeezed, unit);
        EXPECT_LE(after.step_time, before.step_time + 1e-9) << what;
        if (std::string(pattern.name) == "v-half" && m >= 2 * p) EXPECT_LT(after.step_time, before.step_time) << what;
        for (int r = 0; r < p; ++r) {
          EXPECT_LE(after.peak_live_micro_batches[r], *std::max_element(before.peak_live_micro_batches.begin(),
                                                                        before.peak_live_micro_batches.end()))
              << what << " rank " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace twobp
