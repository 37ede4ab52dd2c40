// The table of action meaning (dependencies) and local_producer agree with each other and with every built-in
// schedule: each item an action needs is made available on its rank by an earlier action, which produces it.

#include <gtest/gtest.h>

#include <algorithm>

#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"

namespace twobp {
namespace {

bool contains(const std::vector<ItemRef>& items, const ItemRef& it) {
  return std::find(items.begin(), items.end(), it) != items.end();
}

TEST(Dependencies, TheTable) {
  const int S = 3;
  auto d = dependencies({ActionType::kForward, 1, {2}}, S);
  EXPECT_EQ(d.needs, (std::vector<ItemRef>{{Item::kActivation, 0, 2}}));
  EXPECT_EQ(d.produces, (std::vector<ItemRef>{{Item::kSavedGraph, 1, 2}, {Item::kActivation, 1, 2}}));
  d = dependencies({ActionType::kForward, 2, {0}}, S);  // last stage: its output is the loss, not an item
  EXPECT_EQ(d.produces, (std::vector<ItemRef>{{Item::kSavedGraph, 2, 0}}));
  d = dependencies({ActionType::kBackwardInput, 1, {0}}, S);
  EXPECT_EQ(d.needs, (std::vector<ItemRef>{{Item::kSavedGraph, 1, 0}, {Item::kInputGrad, 2, 0}}));
  EXPECT_EQ(d.produces, (std::vector<ItemRef>{{Item::kPendingWeight, 1, 0}, {Item::kInputGrad, 1, 0}}));
  d = dependencies({ActionType::kBackward, 0, {1}}, S);  // first stage: no input gradient
  EXPECT_EQ(d.needs, (std::vector<ItemRef>{{Item::kSavedGraph, 0, 1}, {Item::kInputGrad, 1, 1}}));
  EXPECT_TRUE(d.produces.empty());
  d = dependencies({ActionType::kBackwardWeight, 2, {0, 3}}, S);
  EXPECT_EQ(d.needs, (std::vector<ItemRef>{{Item::kPendingWeight, 2, 0}, {Item::kPendingWeight, 2, 3}}));
  EXPECT_EQ(dependencies({ActionType::kRecvForward, 2, {1}}, S).produces,
            (std::vector<ItemRef>{{Item::kActivation, 1, 1}}));
  EXPECT_EQ(dependencies({ActionType::kRecvBackward, 0, {1}}, S).produces,
            (std::vector<ItemRef>{{Item::kInputGrad, 1, 1}}));
  EXPECT_EQ(describe(ItemRef{Item::kInputGrad, 1, 4}), "the input gradient of stage 1 micro-batch 4");
}

TEST(Dependencies, EveryNeedOfEveryBuiltinScheduleIsMadeEarlierOnItsRankByItsLocalProducer) {
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : {1, 2, 3, 4}) {
        const Schedule sc = make_schedule(name, default_schedule_options(name, p, 2 * p, mode));
        for (int r = 0; r < p; ++r) {
          const auto& list = sc.actions[r];
          for (std::size_t i = 0; i < list.size(); ++i) {
            for (const ItemRef& need : dependencies(list[i], sc.num_stages).needs) {
              const Action producer = local_producer(need, r, sc);
              // The producer named for this item makes it, by the table...
              EXPECT_TRUE(contains(dependencies(producer, sc.num_stages).produces, need))
                  << name << ": " << describe(producer) << " for " << describe(need);
              // ...and it runs earlier on this rank.
              const auto where = std::find_if(list.begin(), list.begin() + i, [&](const Action& a) {
                return a.type == producer.type && a.stage == producer.stage &&
                       std::find(a.micro_batches.begin(), a.micro_batches.end(), need.micro_batch) !=
                           a.micro_batches.end();
              });
              EXPECT_NE(where, list.begin() + i) << name << " p=" << p << " rank " << r << ": " << describe(list[i])
                                                 << " needs " << describe(need);
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace twobp
