#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/test_scale.h"
#include "twobp/error.h"
#include "twobp/plan/recompute.h"
#include "twobp/schedule/messages.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"

namespace twobp {
namespace {

struct Case {
  std::string name;
  BackwardMode mode;
  int p;
  int m;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.name + "_" + (info.param.mode == BackwardMode::kSplit ? "split" : "standard") + "_p" +
                  std::to_string(info.param.p) + "_m" + std::to_string(info.param.m);
  for (char& c : n) {
    if (c == '-') c = '_';
  }
  return n;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (auto [p, m] : {std::pair{2, 2}, {2, 4}, {4, 4}, {4, 8}}) cases.push_back({name, mode, p, m});
    }
  }
  return cases;
}

ScheduleOptions options_for(const Case& c) {
  return default_schedule_options(c.name, c.p, c.m, c.mode);
}

class BuiltinSchedules : public ::testing::TestWithParam<Case> {};

TEST_P(BuiltinSchedules, GenerateValidateAndRoundTrip) {
  const Case& c = GetParam();
  Schedule sc;
  try {
    sc = make_schedule(c.name, options_for(c));
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << c.name << " rejects p=" << c.p << " m=" << c.m << ": " << e.what();
  }
  EXPECT_EQ(sc.name, c.name);
  EXPECT_EQ(sc.num_ranks, c.p);
  EXPECT_EQ(sc.num_micro_batches, c.m);
  EXPECT_EQ(sc.backward, c.mode);
  const int v = options_for(c).chunks_per_rank;
  EXPECT_EQ(sc.num_stages, c.p * v);
  const std::string text = dump_schedule(sc);
  const Schedule back = load_schedule(text);
  EXPECT_EQ(dump_schedule(back), text);
  EXPECT_EQ(back.actions, sc.actions);
  EXPECT_EQ(back.stage_to_rank, sc.stage_to_rank);
  EXPECT_NO_THROW(validate(back));
  // Every action has a bounded simulation; the fused and split forms do the same work.
  const auto sim = simulate(sc, CostModel::uniform(sc.num_stages, 1.0, 1.0, 1.0));
  EXPECT_GT(sim.step_time, 0.0);
  EXPECT_NEAR(sim.bubble_fraction * sc.num_ranks * sim.step_time,
              sc.num_ranks * sim.step_time - 3.0 * sc.num_stages * c.m, 1e-9);
}

INSTANTIATE_TEST_SUITE_P(All, BuiltinSchedules, ::testing::ValuesIn(all_cases()), case_name);

TEST(Generators, PlacementFollowsTheContract) {
  ScheduleOptions o;
  o.ranks = 4;
  o.micro_batches = 8;
  o.chunks_per_rank = 2;
  EXPECT_EQ(make_schedule("interleaved-1f1b", o).stage_to_rank, (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(make_schedule("interleaved-zb", o).stage_to_rank, (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
  for (const char* name : {"zb-v", "dualpipev", "v-half", "v-min"}) {
    EXPECT_EQ(make_schedule(name, o).stage_to_rank, (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0})) << name;
  }
  o.chunks_per_rank = 3;
  for (const char* name : {"zb-v", "dualpipev", "v-half", "v-min"}) {
    EXPECT_THROW(make_schedule(name, o), ScheduleError) << name << " places exactly 2 chunks per rank";
  }
  EXPECT_EQ(make_schedule("interleaved-zb", o).num_stages, 12);
  o.chunks_per_rank = 1;
  for (const char* name : {"gpipe", "1f1b", "zb-h1", "zb-h2"}) {
    EXPECT_EQ(make_schedule(name, o).stage_to_rank, (std::vector<int>{0, 1, 2, 3})) << name;
  }
  EXPECT_EQ(make_schedule("zb-v", o).num_stages, 8) << "zb-v always has two chunks per rank";
}

// The command lines' recomputation (--recompute [--recompute-ranks N | --recompute-on RANKS]) as a set of ranks,
// the rank lists' text form both ways, and the order in which ranks take up recomputation.
TEST(Generators, RecomputationOnASetOfRanks) {
  using Ranks = std::vector<int>;
  EXPECT_EQ(recomputing_ranks(false, 0, "", 4), Ranks{});
  EXPECT_EQ(recomputing_ranks(false, 2, "1", 4), Ranks{});
  EXPECT_EQ(recomputing_ranks(true, 0, "", 4), (Ranks{0, 1, 2, 3}));
  EXPECT_EQ(recomputing_ranks(true, 1, "", 4), Ranks{0});
  EXPECT_EQ(recomputing_ranks(true, 3, "", 4), (Ranks{0, 1, 2}));
  EXPECT_EQ(recomputing_ranks(true, 9, "", 4), (Ranks{0, 1, 2, 3}));
  EXPECT_EQ(recomputing_ranks(true, 0, "3", 4), Ranks{3});
  EXPECT_EQ(recomputing_ranks(true, 0, "3,0-1,1", 4), (Ranks{0, 1, 3}));
  EXPECT_THROW(recomputing_ranks(true, 2, "3", 4), UsageError);  // both forms
  try {
    recomputing_ranks(true, 0, "1,4", 4);
    ADD_FAILURE() << "rank 4 of 4 accepted";
  } catch (const UsageError& e) {  // names the flag and the value
    EXPECT_NE(std::string(e.what()).find("--recompute-on: ranks '1,4': no rank 4"), std::string::npos) << e.what();
  }
  for (const char* bad : {"4", "-1", "0-", "2-1", "0,,1", "a", "1 ", ",", "0-1-2"}) {
    EXPECT_THROW(parse_ranks(bad, 4), UsageError) << bad;
  }
  try {
    parse_ranks("0,5", 4);
    ADD_FAILURE() << "rank 5 of 4 accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no rank 5 in a pipeline of 4"), std::string::npos) << e.what();
  }
  for (const Ranks& ranks : {Ranks{}, Ranks{0}, Ranks{2}, Ranks{0, 1, 2, 5}, Ranks{1, 3, 5}, Ranks{0, 1, 3, 4, 7}}) {
    const std::string text = format_ranks(ranks);
    if (!ranks.empty()) EXPECT_EQ(parse_ranks(text, 8), ranks) << text;
  }
  EXPECT_EQ(format_ranks({0, 1, 2, 5}), "0-2,5");
  EXPECT_EQ(format_ranks({1, 3}), "1,3");
  EXPECT_TRUE(has_rank({1, 3}, 3));
  EXPECT_FALSE(has_rank({1, 3}, 2));
  EXPECT_EQ(recompute_order({}, 3), (Ranks{0, 1, 2}));
  EXPECT_EQ(recompute_order({5.0, 7.0, 5.0, 9.0}, 4), (Ranks{3, 1, 0, 2}));  // ties by rank
  EXPECT_THROW(recompute_order({1.0}, 2), UsageError);
  EXPECT_EQ(first_ranks_of({3, 1, 0, 2}, 2), (Ranks{1, 3}));
  EXPECT_EQ(first_ranks_of({3, 1, 0, 2}, 0), Ranks{});
  EXPECT_EQ(first_ranks_of({3, 1, 0, 2}, 9), (Ranks{0, 1, 2, 3}));
}

// Any micro-batch count: max(1, m / p) groups as equal as m allows (PyTorch's grouping where it divides m, the
// first m % rounds groups one larger otherwise -- e.g. p = 4, m = 9: 5 + 4). Valid for by-tag and in-order
// pairing (no deadlock) for every p, v and m tried, and the unequal groups cost nothing: with equal costs the
// simulated step grows by exactly one micro-batch's work per micro-batch from m = p on, so the bubble of m = 9
// is that of m = 8 and m = 12.
TEST(Generators, InterleavedTakesAnyMicroBatchCount) {
  for (const char* name : {"interleaved-1f1b", "interleaved-zb"}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : {1, 2, 3, 4, 5}) {
        for (int v : {1, 2, 3}) {
          double at_p = 0.0;
          for (int m = 1; m <= 3 * p + 2; ++m) {
            const std::string what = std::string(name) + (mode == BackwardMode::kSplit ? " 2bp" : " standard") +
                                     " p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m);
            Schedule sc;
            ASSERT_NO_THROW(sc = make_schedule(name, ScheduleOptions{p, m, v, mode})) << what;
            EXPECT_NO_THROW(validate(sc, Pairing::kByTag)) << what;
            EXPECT_NO_THROW(validate(sc, Pairing::kInOrderPerChannel)) << what;
            const double step = simulate(sc, CostModel::uniform(sc.num_stages, 1.0, 1.0, 1.0)).step_time;
            if (m == p) at_p = step;
            if (m > p) EXPECT_DOUBLE_EQ(step, at_p + (m - p) * v * 3.0) << what;
          }
        }
      }
    }
  }
}

TEST(Generators, RejectsBadOptions) {
  ScheduleOptions o;
  o.ranks = 0;
  EXPECT_THROW(make_schedule("1f1b", o), ScheduleError);
  o.ranks = 2;
  o.micro_batches = 0;
  EXPECT_THROW(make_schedule("gpipe", o), ScheduleError);
  o.micro_batches = 4;
  o.chunks_per_rank = 2;
  EXPECT_THROW(make_schedule("1f1b", o), ScheduleError);
  o.chunks_per_rank = 3;
  EXPECT_THROW(make_schedule("zb-v", o), ScheduleError);
  EXPECT_THROW(make_schedule_generator("pipedream"), UsageError);
  try {
    make_schedule_generator("pipedream");
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("zb-v"), std::string::npos) << "should list the known names";
  }
}

// Every schedule that accepts (p, m) must validate, for a wide range including m < p and p = 1. Under the
// sanitizers (reduced scale) m stops at 6: every relation of m to p, fewer repetitions.
TEST(Generators, WideSweepValidates) {
  const int max_m = twobp::testing::reduced_scale() ? 6 : 12;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p = 1; p <= 5; ++p) {
        for (int m = 1; m <= max_m; ++m) {
          for (int v : {1, 2, 3}) {
            ScheduleOptions o{p, m, v, mode};
            Schedule sc;
            try {
              sc = make_schedule_generator(name)->generate(o);
            } catch (const ScheduleError&) {
              continue;  // a documented rejection (tested above)
            }
            EXPECT_NO_THROW(validate(sc)) << name << " p=" << p << " m=" << m << " v=" << v;
          }
        }
      }
    }
  }
}

// one_micro_batch_per_weight: every W of several micro-batches becomes that many W's of one, in its place and
// order; nothing else moves, and the result validates (both pairings) wherever the schedule does.
TEST(Generators, OneMicroBatchPerWeightKeepsTheOrderAndValidates) {
  int split_any = 0;
  for (const std::string& name : builtin_schedule_names()) {
    for (int m : {4, 7}) {
      const Schedule sc = make_schedule(name, default_schedule_options(name, 3, m, BackwardMode::kSplit));
      const Schedule one = one_micro_batch_per_weight(sc);
      for (std::size_t r = 0; r < sc.actions.size(); ++r) {
        std::vector<Action> expanded;
        for (const Action& a : sc.actions[r]) {
          for (int mb : a.type == ActionType::kBackwardWeight ? a.micro_batches : std::vector<int>{-1}) {
            Action part = a;
            if (mb >= 0) part.micro_batches = {mb};
            expanded.push_back(part);
          }
        }
        EXPECT_EQ(one.actions[r], expanded) << name << " m=" << m << " rank " << r;
      }
      const bool changed = one.actions != sc.actions;
      split_any += changed;
      EXPECT_EQ(one.name, changed ? sc.name + " (one micro-batch per W)" : sc.name);
      EXPECT_NO_THROW(validate(one)) << name << " m=" << m;
      EXPECT_NO_THROW(validate(one, Pairing::kInOrderPerChannel)) << name << " m=" << m;
    }
  }
  EXPECT_GT(split_any, 0) << "no built-in batches W's: the test tests nothing";
}

// The built-in generators run micro-batches in increasing order per stage for F and for I/B (a property of theirs:
// validate() accepts any order, which PyTorch's looped BFS uses).
TEST(Generators, IncreasingMicroBatchOrderPerStage) {
  for (const std::string& name : builtin_schedule_names()) {
    if (name == "looped-bfs") continue;  // PyTorch's order: backwards from the last micro-batch (see below)
    const ScheduleOptions o = default_schedule_options(name, 4, 8, BackwardMode::kSplit);
    const Schedule sc = make_schedule(name, o);
    for (const auto& list : sc.actions) {
      std::map<std::pair<int, int>, int> last;
      for (const Action& a : list) {
        if (a.type == ActionType::kBackwardWeight) continue;
        auto [it, inserted] = last.try_emplace({static_cast<int>(a.type), a.stage}, a.micro_batches[0]);
        if (!inserted) {
          EXPECT_GT(a.micro_batches[0], it->second) << name << " " << describe(a);
          it->second = a.micro_batches[0];
        }
      }
    }
  }
}

TEST(Generators, TwoBpSplitFormsBatchTheTailW) {
  const Schedule g = make_schedule("gpipe", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  for (const auto& list : g.actions) {
    ASSERT_FALSE(list.empty());
    EXPECT_EQ(list.back().type, ActionType::kBackwardWeight);
    EXPECT_EQ(list.back().micro_batches, (std::vector<int>{0, 1, 2, 3}));
  }
  // 1F1B p=2 m=2: rank 0 fills its cool-down gap with W0, rank 1 batches both W at the end.
  const Schedule s = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  const std::string text = dump_schedule(s);
  EXPECT_NE(text.find("rank 0: I 0 0\nrank 0: W 0 0\nrank 0: RECV_B 0 1\nrank 0: I 0 1\nrank 0: W 0 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 1: W 1 0,1\n"), std::string::npos) << text;
}

TEST(Generators, CommunicationPlacement) {
  const Schedule sc = make_schedule("1f1b", ScheduleOptions{2, 1, 1, BackwardMode::kStandard});
  const std::vector<Action> r0 = {{ActionType::kForward, 0, {0}},
                                  {ActionType::kSendForward, 0, {0}},
                                  {ActionType::kRecvBackward, 0, {0}},
                                  {ActionType::kBackward, 0, {0}}};
  const std::vector<Action> r1 = {{ActionType::kRecvForward, 1, {0}},
                                  {ActionType::kForward, 1, {0}},
                                  {ActionType::kBackward, 1, {0}},
                                  {ActionType::kSendBackward, 1, {0}}};
  EXPECT_EQ(sc.actions[0], r0);
  EXPECT_EQ(sc.actions[1], r1);
  // zb-v's turning point (stages p-1 and p on rank p-1) and p = 1 hand over locally: no messages.
  const Schedule v = make_schedule("zb-v", ScheduleOptions{1, 3, 2, BackwardMode::kSplit});
  for (const Action& a : v.actions[0]) EXPECT_TRUE(is_compute(a.type)) << describe(a);
  // add_communication is idempotent.
  EXPECT_EQ(add_communication(sc).actions, sc.actions);
}

TEST(Generators, PeerRankAndTags) {
  const Schedule sc = make_schedule("zb-v", ScheduleOptions{2, 4, 2, BackwardMode::kSplit});
  std::map<std::int64_t, int> sends, recvs;
  for (int r = 0; r < sc.num_ranks; ++r) {
    for (const Action& a : sc.actions[r]) {
      if (is_compute(a.type)) {
        EXPECT_THROW(peer_rank(sc, a), ScheduleError);
        continue;
      }
      const int peer = peer_rank(sc, a);
      EXPECT_NE(peer, r);
      const std::int64_t tag = message_tag(sc, a);
      const bool send = is_send(a.type);
      EXPECT_TRUE((send ? sends : recvs).emplace(tag, r).second) << "tag reused: " << describe(a);
    }
  }
  ASSERT_EQ(sends.size(), recvs.size());
  for (const auto& [tag, rank] : sends) {
    ASSERT_TRUE(recvs.count(tag)) << tag;
    EXPECT_NE(recvs[tag], rank);
  }
  // The documented formula: one tag per part (header, tensor 0, tensor 1, ...) of each message.
  constexpr int kParts = kMaxTensorsPerMessage + 1;
  EXPECT_EQ(message_tag(sc, Action{ActionType::kSendForward, 1, {3}}), ((3 * 4 + 1) * 2 + 0) * kParts + 1);
  EXPECT_EQ(message_tag(sc, Action{ActionType::kRecvForward, 2, {3}}), ((3 * 4 + 1) * 2 + 0) * kParts + 1);
  EXPECT_EQ(message_tag(sc, Action{ActionType::kSendBackward, 2, {3}}), ((3 * 4 + 1) * 2 + 1) * kParts + 1);
  EXPECT_EQ(message_tag(sc, Action{ActionType::kRecvBackward, 1, {3}}, MessagePart{2}),
            ((3 * 4 + 1) * 2 + 1) * kParts + 3);
  EXPECT_EQ(message_tag(sc, Action{ActionType::kSendForward, 1, {3}}, MessagePart::header()),
            ((3 * 4 + 1) * 2 + 0) * kParts);
  EXPECT_EQ(message_channel(Action{ActionType::kSendBackward, 2, {3}}, MessagePart::header()), 3);
  EXPECT_THROW(message_tag(sc, Action{ActionType::kSendForward, 1, {3}}, MessagePart{kMaxTensorsPerMessage}),
               UsageError);
  EXPECT_EQ(peer_rank(sc, Action{ActionType::kSendForward, 1, {0}}), 1);  // stage 2 is on rank 1 (V)
  EXPECT_EQ(peer_rank(sc, Action{ActionType::kSendForward, 2, {0}}), 0);
}

// For every (sender, receiver, direction), the receiver's RECVs come in the order of the sender's SENDs, so a
// transport that matches the messages of one link and direction in order pairs them right. (The two directions
// of a link may interleave differently on the two sides, e.g. in zb-v.)
TEST(Generators, MessagesOfALinkAndDirectionMatchInOrder) {
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : {2, 3, 4}) {
        for (int m : {4, 8, 12}) {
          Schedule sc;
          try {
            sc = make_schedule(name, default_schedule_options(name, p, m, mode));
          } catch (const ScheduleError&) {
            continue;
          }
          std::map<std::tuple<int, int, int>, std::vector<std::int64_t>> sends, recvs;
          for (int r = 0; r < p; ++r) {
            for (const Action& a : sc.actions[r]) {
              if (is_compute(a.type)) continue;
              const int dir = a.type == ActionType::kSendForward || a.type == ActionType::kRecvForward ? 0 : 1;
              const int peer = peer_rank(sc, a);
              if (is_send(a.type)) {
                sends[{r, peer, dir}].push_back(message_tag(sc, a));
              } else {
                recvs[{peer, r, dir}].push_back(message_tag(sc, a));
              }
            }
          }
          EXPECT_EQ(sends, recvs) << name << " p=" << p << " m=" << m;
        }
      }
    }
  }
}

}  // namespace
}  // namespace twobp
