#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "common/pairing_schedule.h"
#include "schedule/schedule_test_util.h"
#include "twobp/error.h"
#include "twobp/schedule/messages.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"

namespace twobp {
namespace {

using test::act;
using test::two_stage;
constexpr auto F = ActionType::kForward;
constexpr auto I = ActionType::kBackwardInput;
constexpr auto W = ActionType::kBackwardWeight;
constexpr auto B = ActionType::kBackward;
constexpr auto SF = ActionType::kSendForward;
constexpr auto RF = ActionType::kRecvForward;
constexpr auto SB = ActionType::kSendBackward;
constexpr auto RB = ActionType::kRecvBackward;

// The smallest valid two-rank program: one micro-batch, fused backward.
Schedule base() {
  return two_stage({{act(F, 0, {0}), act(SF, 0, {0}), act(RB, 0, {0}), act(B, 0, {0})},
                    {act(RF, 1, {0}), act(F, 1, {0}), act(B, 1, {0}), act(SB, 1, {0})}});
}

Schedule one_rank(std::vector<Action> actions, int m = 1, BackwardMode mode = BackwardMode::kSplit) {
  Schedule sc;
  sc.name = "single";
  sc.num_ranks = 1;
  sc.num_stages = 1;
  sc.num_micro_batches = m;
  sc.backward = mode;
  sc.stage_to_rank = {0};
  sc.actions = {std::move(actions)};
  return sc;
}

// Expects validate() to throw ScheduleError whose message contains every word in `words`.
void expect_rejected(const Schedule& sc, std::vector<std::string> words) {
  try {
    validate(sc);
    ADD_FAILURE() << "expected ScheduleError for:\n" << dump_schedule(sc);
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    for (const std::string& w : words) EXPECT_NE(what.find(w), std::string::npos) << "'" << w << "' not in:\n" << what;
  }
}

void erase(std::vector<Action>& list, const Action& a) {
  auto it = std::find(list.begin(), list.end(), a);
  ASSERT_NE(it, list.end());
  list.erase(it);
}

TEST(Validate, AcceptsBase) { EXPECT_NO_THROW(validate(base())); }

TEST(Validate, MissingForward) {
  Schedule sc = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kStandard});
  erase(sc.actions[1], act(F, 1, {1}));
  expect_rejected(sc, {"missing F", "stage 1", "micro-batch 1", "rank 1", "rank 0 |"});
}

TEST(Validate, MissingWeight) {
  Schedule sc = make_schedule("gpipe", ScheduleOptions{1, 2, 1, BackwardMode::kSplit});
  sc.actions[0].back() = act(W, 0, {0});
  expect_rejected(sc, {"missing W", "micro-batch 1"});
}

TEST(Validate, InputGradBeforeForward) {
  expect_rejected(one_rank({act(I, 0, {0}), act(F, 0, {0}), act(W, 0, {0})}),
                  {"rank 0", "I stage 0 micro-batch 0", "before F stage 0 micro-batch 0", "[I0]"});
}

TEST(Validate, WeightBeforeInput) {
  expect_rejected(one_rank({act(F, 0, {0}), act(W, 0, {0}), act(I, 0, {0})}),
                  {"rank 0", "W stage 0 micro-batch 0", "W runs before I stage 0 micro-batch 0", "[W0]"});
}

TEST(Validate, SendWithoutRecv) {
  Schedule sc = base();
  erase(sc.actions[1], act(RF, 1, {0}));
  expect_rejected(sc, {"rank 0", "SEND_F stage 0 micro-batch 0", "no matching RECV_F stage 1 micro-batch 0 on rank 1"});
}

TEST(Validate, RecvWithoutSend) {
  Schedule sc = base();
  erase(sc.actions[0], act(SF, 0, {0}));
  expect_rejected(sc, {"rank 1", "RECV_F stage 1 micro-batch 0", "no matching SEND_F stage 0 micro-batch 0 on rank 0"});
}

TEST(Validate, WrongRank) {
  Schedule sc = base();
  sc.actions[0].push_back(act(B, 1, {0}));
  erase(sc.actions[1], act(B, 1, {0}));
  expect_rejected(sc, {"rank 0", "B stage 1 micro-batch 0", "owned by rank 1"});
}

TEST(Validate, DuplicatedMicroBatch) {
  Schedule sc = base();
  sc.actions[0].insert(sc.actions[0].begin() + 1, act(F, 0, {0}));
  expect_rejected(sc, {"duplicate", "F stage 0 micro-batch 0", "rank 0"});
  Schedule w =
      one_rank({act(F, 0, {0}), act(F, 0, {1}), act(I, 0, {0}), act(I, 0, {1}), act(W, 0, {0, 1}), act(W, 0, {1})}, 2);
  expect_rejected(w, {"duplicate", "W stage 0 micro-batch 1"});
}

TEST(Validate, Deadlock) {
  // Each rank receives before it sends what the other waits for.
  Schedule sc = two_stage({{act(RB, 0, {0}), act(F, 0, {0}), act(SF, 0, {0}), act(B, 0, {0})},
                           {act(RF, 1, {0}), act(F, 1, {0}), act(B, 1, {0}), act(SB, 1, {0})}});
  expect_rejected(
      sc, {"deadlock", "rank 0 waits at action #0 (RECV_B stage 0 micro-batch 0) for SEND_B stage 1 micro-batch 0",
           "rank 1 waits at action #0 (RECV_F stage 1 micro-batch 0)", "never runs"});
}

TEST(Validate, ComputeBeforeItsReceive) {
  Schedule sc = base();
  std::swap(sc.actions[1][0], sc.actions[1][1]);
  expect_rejected(sc, {"rank 1", "F stage 1 micro-batch 0", "expected RECV_F stage 1 micro-batch 0 earlier"});
}

TEST(Validate, WrongBackwardKind) {
  expect_rejected(one_rank({act(F, 0, {0}), act(I, 0, {0}), act(W, 0, {0})}, 1, BackwardMode::kStandard),
                  {"must use B", "found I"});
}

// A split schedule may fuse the backward of some micro-batches (DualPipeV): each is then backpropagated by B, or by
// I and W, never both.
TEST(Validate, SplitScheduleWithSomeFusedBackwards) {
  EXPECT_NO_THROW(validate(one_rank({act(F, 0, {0}), act(F, 0, {1}), act(B, 0, {0}), act(I, 0, {1}), act(W, 0, {1})},
                                    2, BackwardMode::kSplit)));
  expect_rejected(one_rank({act(F, 0, {0}), act(B, 0, {0}), act(W, 0, {0})}, 1, BackwardMode::kSplit),
                  {"W of stage 0 micro-batch 0", "fused B"});
  expect_rejected(one_rank({act(F, 0, {0}), act(F, 0, {1}), act(B, 0, {0}), act(I, 0, {1})}, 2, BackwardMode::kSplit),
                  {"missing W for stage 0 micro-batch 1"});
}

// Micro-batches may go in any order per stage (PyTorch's looped BFS runs its backward from the last one).
TEST(Validate, AnyMicroBatchOrder) {
  EXPECT_NO_THROW(validate(
      one_rank({act(F, 0, {1}), act(F, 0, {0}), act(B, 0, {0}), act(B, 0, {1})}, 2, BackwardMode::kStandard)));
}

TEST(Validate, LocalHandOverNeedsNoMessages) {
  Schedule sc = make_schedule("zb-v", ScheduleOptions{1, 1, 2, BackwardMode::kStandard});
  sc.actions[0].insert(sc.actions[0].begin() + 1, act(SF, 0, {0}));
  expect_rejected(sc, {"both on rank 0", "expected no communication"});
}

TEST(Validate, Structure) {
  Schedule sc = base();
  sc.actions[0][0].stage = 5;
  expect_rejected(sc, {"stage out of range"});
  sc = base();
  sc.actions[0][0].micro_batches = {3};
  expect_rejected(sc, {"micro-batch 3 out of range"});
  sc = base();
  sc.stage_to_rank = {0, 2};
  expect_rejected(sc, {"placed on rank 2"});
  sc = base();
  sc.actions.pop_back();
  expect_rejected(sc, {"action lists for 2 ranks"});
  sc = base();
  sc.actions[0][0].micro_batches = {0, 1};
  sc.num_micro_batches = 2;
  expect_rejected(sc, {"only W may batch"});
}

TEST(Validate, SimulateReportsDeadlockToo) {
  Schedule sc = two_stage({{act(RB, 0, {0}), act(F, 0, {0}), act(SF, 0, {0}), act(B, 0, {0})},
                           {act(RF, 1, {0}), act(F, 1, {0}), act(B, 1, {0}), act(SB, 1, {0})}});
  EXPECT_THROW(simulate(sc, CostModel::uniform(2, 1, 1, 1)), ScheduleError);
}

// Pairing: a schedule valid for by-tag transports, whose activation channel 0 -> 1 is posted in different orders.
// Overlapped F&B pairs (Action::overlapped_with_next): dualpipev's are valid as generated and in the layout that
// runs them at once (for_overlapped_pairs: the B's receives before the F, the F's sends after the B).
TEST(ValidateOverlappedPairs, DualPipeVPairsAndTheirRunAtOnceLayout) {
  for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
    const Schedule sc = make_schedule("dualpipev", ScheduleOptions{4, 8, 2, mode});
    const Schedule at_once = for_overlapped_pairs(sc);
    int pairs = 0;
    for (int r = 0; r < sc.num_ranks; ++r) {
      const auto& list = at_once.actions[r];
      ASSERT_EQ(list.size(), sc.actions[r].size());
      for (std::size_t i = 0; i < list.size(); ++i) {
        if (!list[i].overlapped_with_next) continue;
        ++pairs;
        ASSERT_LT(i + 1, list.size());
        EXPECT_EQ(list[i].type, F);
        EXPECT_TRUE(list[i + 1].type == B || list[i + 1].type == I) << describe(list[i + 1]);
        EXPECT_NE(list[i + 1].stage, list[i].stage);
      }
    }
    EXPECT_GT(pairs, 0);
    EXPECT_NO_THROW(validate(sc, Pairing::kInOrderPerChannel));
    EXPECT_NO_THROW(validate(at_once, Pairing::kInOrderPerChannel));
    EXPECT_EQ(for_overlapped_pairs(at_once).actions, at_once.actions) << "the layout is its own fixed point";
    EXPECT_EQ(load_schedule(dump_schedule(sc)).actions, sc.actions) << "the text form keeps the pairs";
  }
}

TEST(ValidateOverlappedPairs, MalformedPairsAreRefused) {
  const Schedule sc = make_schedule("dualpipev", ScheduleOptions{2, 4, 2, BackwardMode::kStandard});
  auto first_pair = [](const std::vector<Action>& list) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (list[i].overlapped_with_next) return i;
    }
    return list.size();
  };
  const std::size_t at = first_pair(sc.actions[0]);
  ASSERT_LT(at, sc.actions[0].size());
  {
    Schedule bad = sc;  // the flag on the B instead
    bad.actions[0][at].overlapped_with_next = false;
    std::size_t j = at + 1;
    while (!is_compute(bad.actions[0][j].type)) ++j;
    bad.actions[0][j].overlapped_with_next = true;
    expect_rejected(bad, {"only an F may open an overlapped pair"});
  }
  {
    Schedule bad = sc;  // something else between the parts: a gradient send of rank 0's stage 3
    bad.actions[0].insert(bad.actions[0].begin() + static_cast<long>(at) + 1, act(SB, 3, {0}));
    expect_rejected(bad, {"between the parts of an overlapped pair"});
  }
  {
    Schedule bad = sc;  // an F whose next compute action is another F
    for (std::size_t i = 0; i + 1 < bad.actions[0].size(); ++i) {
      if (bad.actions[0][i].type == F && bad.actions[0][i + 1].type == F) {
        bad.actions[0][i].overlapped_with_next = true;
        break;
      }
    }
    expect_rejected(bad, {"is an F and the B or I that follows it"});
  }
  // Both parts on one stage.
  Schedule same = one_rank({act(F, 0, {0}), act(F, 0, {1}), act(B, 0, {0}), act(B, 0, {1})}, 2,
                           BackwardMode::kStandard);
  same.actions[0][1].overlapped_with_next = true;
  expect_rejected(same, {"different stages"});
}

// Valid in order, a deadlock at once: 4 stages looped over 2 ranks, rank 0 pairs F of stage 2 micro-batch 1 with B
// of stage 0 micro-batch 0; rank 1 sends that B's gradient only after the F's activation arrived, which the pair,
// run at once, would send only after that gradient arrived. validate() names the layout that fails.
TEST(ValidateOverlappedPairs, APairThatWouldDeadlockWhenRunAtOnceIsRefused) {
  Schedule sc;
  sc.name = "pair-deadlock";
  sc.num_ranks = 2;
  sc.num_stages = 4;
  sc.num_micro_batches = 2;
  sc.backward = BackwardMode::kStandard;
  sc.stage_to_rank = {0, 1, 0, 1};
  sc.actions = {{act(F, 0, {0}), act(SF, 0, {0}), act(F, 0, {1}), act(SF, 0, {1}), act(RF, 2, {0}), act(F, 2, {0}),
                 act(SF, 2, {0}), act(RB, 2, {0}), act(B, 2, {0}), act(SB, 2, {0}), act(RF, 2, {1}), act(F, 2, {1}),
                 act(SF, 2, {1}), act(RB, 0, {0}), act(B, 0, {0}), act(RB, 2, {1}), act(B, 2, {1}), act(SB, 2, {1}),
                 act(RB, 0, {1}), act(B, 0, {1})},
                {act(RF, 1, {0}), act(F, 1, {0}), act(SF, 1, {0}), act(RF, 1, {1}), act(F, 1, {1}), act(SF, 1, {1}),
                 act(RF, 3, {0}), act(F, 3, {0}), act(B, 3, {0}), act(SB, 3, {0}), act(RF, 3, {1}), act(F, 3, {1}),
                 act(RB, 1, {0}), act(B, 1, {0}), act(SB, 1, {0}), act(B, 3, {1}), act(SB, 3, {1}), act(RB, 1, {1}),
                 act(B, 1, {1}), act(SB, 1, {1})}};
  EXPECT_NO_THROW(validate(sc));
  sc.actions[0][11].overlapped_with_next = true;  // F stage 2 micro-batch 1, beside B stage 0 micro-batch 0
  ASSERT_EQ(sc.actions[0][11], (Action{F, 2, {1}, true}));
  expect_rejected(sc, {"valid run in order, but not with its overlapped pairs run at once", "deadlock"});
}

TEST(ValidatePairing, InOrderTransportsRejectDifferentPostingOrders) {
  const Schedule sc = testing::breadth_first_vs_depth_first();
  EXPECT_NO_THROW(validate(sc, Pairing::kByTag));
  try {
    validate(sc, Pairing::kInOrderPerChannel);
    ADD_FAILURE() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    for (const char* word : {"in-order pairing", "channel 0 (activations) from rank 0 to rank 1", "receive #1",
                             "RECV_F stage 3 micro-batch 0", "SEND_F stage 0 micro-batch 1", "rank 1"}) {
      EXPECT_NE(what.find(word), std::string::npos) << "'" << word << "' not in:\n" << what;
    }
  }
}

TEST(ValidatePairing, ChannelsSeparateActivationsFromGradients) {
  EXPECT_EQ(message_channel(act(SF, 0, {0})), 0);
  EXPECT_EQ(message_channel(act(RF, 1, {0})), 0);
  EXPECT_EQ(message_channel(act(SB, 1, {0})), 1);
  EXPECT_EQ(message_channel(act(RB, 0, {0})), 1);
  EXPECT_THROW(message_channel(act(F, 0, {0})), ScheduleError);
  EXPECT_EQ(pairing_of("nccl"), Pairing::kInOrderPerChannel);
  EXPECT_EQ(pairing_of("local-in-order"), Pairing::kInOrderPerChannel);
  EXPECT_EQ(pairing_of("mpi"), Pairing::kByTag);
  EXPECT_THROW(pairing_of("carrier-pigeon"), UsageError);
}

// Every built-in schedule pairs on in-order transports thanks to the channels (zb-v would not with one channel
// per rank pair: its links carry activations of one chunk and gradients of the other). twobp_bench
// check-schedules covers p up to 8; this is the quick guard.
TEST(ValidatePairing, EveryBuiltinSchedulePairsInOrder) {
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : {2, 3, 4}) {
        for (int m : {p, p + 1, 2 * p, 3 * p}) {
          const ScheduleOptions so = default_schedule_options(name, p, m, mode);
          EXPECT_NO_THROW(validate(make_schedule(name, so), Pairing::kInOrderPerChannel))
              << name << " p=" << p << " m=" << m;
        }
      }
    }
  }
}

}  // namespace
}  // namespace twobp
