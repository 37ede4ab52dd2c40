// The hang report as a function of what each rank was doing: the verdict follows who waits on whom, for every
// kind of end of a chain (a dead rank, one in compute, one outside the step before or after it, one that failed,
// one waiting on no rank) and for cycles, whatever the number of ranks and wherever the chain starts.
#include "twobp/runtime/hang_report.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace twobp {
namespace {

using State = RankStatus::State;
using Statuses = std::vector<std::optional<RankStatus>>;

RankStatus waiting(int peer, const std::string& action, std::int64_t run = 4) {
  return RankStatus{State::kWaiting, action, peer, run, 1.25, ""};
}

// p ranks in a chain 0 -> 1 -> ... -> p-2, all waiting on the next for a gradient, and `last` at the end.
Statuses chain(int p, std::optional<RankStatus> last) {
  Statuses s;
  for (int r = 0; r + 1 < p; ++r) {
    s.push_back(waiting(r + 1, "RECV_B stage " + std::to_string(r) + " micro-batch 1"));
  }
  s.push_back(std::move(last));
  return s;
}

std::string verdict(const std::string& report) { return report.substr(0, report.find('\n')); }

TEST(HangReport, StatusesRoundTripThroughText) {
  for (const RankStatus& s : {RankStatus{State::kWaiting, "RECV_F stage 2 micro-batch 7", 1, 12, 3.5, ""},
                              RankStatus{State::kComputing, "W stage 0 micro-batch 0", -1, 0, 0.0, ""},
                              RankStatus{State::kFailed, "", -1, 3, 2.0, "rank 1: \"quoted\"\nnew line"},
                              RankStatus{}}) {
    const auto back = decode_rank_status(encode(s));
    ASSERT_TRUE(back);
    EXPECT_EQ(back->state, s.state);
    EXPECT_EQ(back->action, s.action);
    EXPECT_EQ(back->peer, s.peer);
    EXPECT_EQ(back->run, s.run);
    EXPECT_EQ(back->seconds, s.seconds);
    EXPECT_EQ(back->detail, s.detail);
    EXPECT_EQ(back->peers, s.peers);
  }
  RankStatus collective{State::kWaiting, "", -1, 2, 1.0, "the data-parallel gradient reduction"};
  collective.peers = {3, 5};
  const auto back = decode_rank_status(encode(collective));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->peers, collective.peers);
  // A status without "peers" (no collective) still reads.
  const auto plain = decode_rank_status(
      R"({"state":"waiting","action":"RECV_F stage 1 micro-batch 0","peer":0,"run":1,"seconds":0.5,"detail":""})");
  ASSERT_TRUE(plain);
  EXPECT_TRUE(plain->peers.empty());
  EXPECT_EQ(plain->peer, 0);
  for (const char* bad : {"", "null", "{}", "[1,2]", "{\"state\":\"sleeping\",\"action\":\"\",\"peer\":-1,"
                                                      "\"run\":0,\"seconds\":0,\"detail\":\"\"}", "not json"}) {
    EXPECT_FALSE(decode_rank_status(bad)) << bad;
  }
}

TEST(HangReport, NamesTheRankAtTheEndOfEveryChain) {
  for (int p : {2, 3, 4, 8}) {
    SCOPED_TRACE("ranks " + std::to_string(p));
    const int end = p - 1;
    const std::string who = "rank " + std::to_string(end);
    // Dead (or unreachable): no answer.
    auto r = hang_report(chain(p, std::nullopt), 0);
    EXPECT_NE(verdict(r).find(who + " did not answer: it is dead"), std::string::npos) << r;
    EXPECT_NE(r.find("  " + who + ": did not answer"), std::string::npos) << r;
    // Stuck in compute.
    r = hang_report(chain(p, RankStatus{State::kComputing, "F stage 3 micro-batch 2", -1, 4, 9.5, ""}), end - 1);
    EXPECT_NE(verdict(r).find(who + " is computing F stage 3 micro-batch 2 for 9.5 s and waits for no message"),
              std::string::npos)
        << r;
    // Finished its part of the same run: what it sent went missing.
    r = hang_report(chain(p, RankStatus{State::kOutsideStep, "", -1, 4, 0.5, ""}), 0);
    EXPECT_NE(verdict(r).find(who + " finished its part of run 4: a message it sent was lost"), std::string::npos)
        << r;
    // Still before the run: its caller has not called step().
    r = hang_report(chain(p, RankStatus{State::kOutsideStep, "", -1, 3, 2.0, ""}), 0);
    EXPECT_NE(verdict(r).find(who + " has not started run 4 (it ended run 3 2.0 s ago): its caller has not called"),
              std::string::npos)
        << r;
    r = hang_report(chain(p, RankStatus{}), 0);
    EXPECT_NE(verdict(r).find(who + " has not started run 4 (it has run no step yet)"), std::string::npos) << r;
    // Failed, and waiting on something that is no rank.
    r = hang_report(chain(p, RankStatus{State::kFailed, "", -1, 4, 0.1, "NumericalError: loss is nan"}), 0);
    EXPECT_NE(verdict(r).find(who + " failed: NumericalError: loss is nan"), std::string::npos) << r;
    r = hang_report(chain(p, RankStatus{State::kWaiting, "", -1, 4, 1.0, "its last sends of the step"}), 0);
    EXPECT_NE(verdict(r).find(who + " is waiting for its last sends of the step and for no other rank"),
              std::string::npos)
        << r;
    // One line per rank, the reporter named, the waits described with their peer.
    EXPECT_NE(r.find("hang report (by rank 0, " + std::to_string(p) + " ranks)"), std::string::npos) << r;
    EXPECT_EQ(static_cast<int>(std::count(r.begin(), r.end(), '\n')), p);
    EXPECT_NE(r.find("rank 0: waiting 1.2 s for RECV_B stage 0 micro-batch 1 from rank 1 (run 4)"),
              std::string::npos)
        << r;
  }
}

TEST(HangReport, TheVerdictDoesNotDependOnWhoReports) {
  const Statuses s = chain(4, RankStatus{State::kComputing, "B stage 3 micro-batch 0", -1, 4, 3.0, ""});
  const std::string first = verdict(hang_report(s, 0));
  for (int reporter : {1, 2, 3}) {
    std::string v = verdict(hang_report(s, reporter));
    v.replace(v.find("by rank " + std::to_string(reporter)), 9, "by rank 0");
    EXPECT_EQ(v, first);
  }
}

TEST(HangReport, TwoChainsEndingAtTwoRanksNameBoth) {
  // 0 -> 1 (computing), 2 -> 3 (dead): both ends are named, in rank order.
  const Statuses s{waiting(1, "RECV_F stage 0 micro-batch 0"),
                   RankStatus{State::kComputing, "F stage 1 micro-batch 0", -1, 4, 2.0, ""},
                   waiting(3, "RECV_B stage 2 micro-batch 0"), std::nullopt};
  const std::string v = verdict(hang_report(s, 0));
  const auto one = v.find("rank 1 is computing"), three = v.find("rank 3 did not answer");
  ASSERT_NE(one, std::string::npos) << v;
  ASSERT_NE(three, std::string::npos) << v;
  EXPECT_LT(one, three);
}

TEST(HangReport, ACycleOfWaitsIsADeadlock) {
  for (int p : {2, 3, 5}) {
    Statuses s;
    for (int r = 0; r < p; ++r) s.push_back(waiting((r + 1) % p, "RECV_F stage 0 micro-batch 0"));
    const std::string v = verdict(hang_report(s, p - 1));
    std::string ring;
    for (int r = 0; r <= p; ++r) ring += (r ? " -> " : "") + std::to_string(r % p);
    EXPECT_NE(v.find("ranks " + ring + " wait on each other in a cycle"), std::string::npos) << v;
  }
  // A chain into a cycle names the cycle once, starting at its lowest rank.
  const Statuses s{waiting(1, "a"), waiting(2, "b"), waiting(1, "c")};
  const std::string v = verdict(hang_report(s, 0));
  EXPECT_NE(v.find("ranks 1 -> 2 -> 1 wait on each other"), std::string::npos) << v;
  EXPECT_EQ(v.find("ranks 2 -> 1"), std::string::npos) << v;
}

TEST(HangReport, NobodyWaitingIsSaidSo) {
  const Statuses s{RankStatus{}, RankStatus{State::kComputing, "F stage 1 micro-batch 0", -1, 0, 1.0, ""}};
  EXPECT_NE(hang_report(s, 0).find("no rank waits for another"), std::string::npos);
  // A peer outside the group is no edge.
  const Statuses out_of_range{waiting(7, "RECV_F stage 0 micro-batch 0"), RankStatus{}};
  EXPECT_NE(hang_report(out_of_range, 0).find("no rank waits for another"), std::string::npos);
}

// A rank waiting in a collective (peers: the collective's other ranks) waits for those that have not joined it,
// i.e. are not waiting in the same collective of the same run; the chain goes on from them, into their own waits.
RankStatus in_collective(std::vector<int> peers, std::int64_t run = 4, const std::string& what = "the reduction") {
  RankStatus s{State::kWaiting, "", -1, run, 1.5, what};
  s.peers = std::move(peers);
  return s;
}

TEST(HangReport, ACollectiveWaitsForTheRanksThatHaveNotJoinedIt) {
  const RankStatus stuck{State::kComputing, "F stage 1 micro-batch 3", -1, 4, 2.0, ""};
  // 0 and 2 are in the collective of ranks {0, 1, 2}; 1 waits for 3's message; 3 computes.
  Statuses s{in_collective({1, 2}), waiting(3, "RECV_F stage 1 micro-batch 3"), in_collective({0, 1}), stuck};
  for (int reporter : {0, 1, 2, 3}) {
    const std::string r = hang_report(s, reporter);
    const std::string v = verdict(r), v0 = verdict(hang_report(s, 0));
    EXPECT_EQ(v.substr(v.find("): ")), v0.substr(v0.find("): ")));
    EXPECT_NE(verdict(r).find("rank 3 is computing F stage 1 micro-batch 3"), std::string::npos) << r;
    EXPECT_EQ(verdict(r).find("cycle"), std::string::npos) << "0 and 2 joined: no cycle between them\n" << r;
    EXPECT_NE(r.find("rank 0: waiting 1.5 s for the reduction with ranks 1, 2 (run 4)"), std::string::npos) << r;
  }
  // Every rank of the collective in it, each named by the others: nothing to follow, no cycle.
  EXPECT_EQ(verdict(hang_report({in_collective({1}), in_collective({0})}, 0)).find("cycle"), std::string::npos);
  // A rank outside the step never joined: it is the culprit, named once.
  s = {in_collective({1, 2}), RankStatus{State::kOutsideStep, "", -1, 3, 4.0, ""}, in_collective({0, 1})};
  const std::string late = verdict(hang_report(s, 2));
  EXPECT_NE(late.find("rank 1 has not started run 4"), std::string::npos) << late;
  EXPECT_EQ(late.find("rank 1", late.find("rank 1") + 1), std::string::npos) << late;
}

TEST(HangReport, ARankThatFinishedTheRunButNotJoinedTheCollectiveIsSaidSo) {
  const RankStatus after{State::kOutsideStep, "", -1, 4, 1.0, ""};
  const std::string v = verdict(hang_report({in_collective({1}, 4, "the gradient check"), after}, 0));
  EXPECT_NE(v.find("rank 1 finished its part of run 4 1.0 s ago and has not joined the gradient check"),
            std::string::npos) << v;
  // Waited for by a message instead: that message was lost.
  const std::string m = verdict(hang_report({waiting(1, "RECV_B stage 0 micro-batch 3"), after}, 0));
  EXPECT_NE(m.find("rank 1 finished its part of run 4: a message it sent was lost"), std::string::npos) << m;
}

TEST(HangReport, ACollectiveOfAnotherRunOrKindIsNotJoined) {
  const RankStatus dead_end{State::kFailed, "", -1, 4, 0.5, "NumericalError: loss is nan"};
  // Rank 1 waits in an older run's collective, rank 2 in another collective: neither joined rank 0's, so both are
  // followed -- into a cycle with rank 0 (a deadlock: their orders disagree) -- and rank 3's failure is named.
  const Statuses s{in_collective({1, 2, 3}), in_collective({0}, 3), in_collective({0}, 4, "the norm"), dead_end};
  const std::string v = verdict(hang_report(s, 0));
  EXPECT_NE(v.find("rank 3 failed: NumericalError: loss is nan"), std::string::npos) << v;
  EXPECT_NE(v.find("ranks 0 -> 1 -> 0 wait on each other in a cycle"), std::string::npos) << v;
  EXPECT_NE(v.find("ranks 0 -> 2 -> 0 wait on each other in a cycle"), std::string::npos) << v;
}

TEST(HangReport, ACollectiveWaitingOnTwoLateRanksNamesBoth) {
  const Statuses s{in_collective({1, 2}), std::nullopt,
                   RankStatus{State::kComputing, "W stage 2 micro-batch 0", -1, 4, 3.0, ""}};
  const std::string v = verdict(hang_report(s, 0));
  EXPECT_NE(v.find("rank 1 did not answer"), std::string::npos) << v;
  EXPECT_NE(v.find("rank 2 is computing W stage 2 micro-batch 0"), std::string::npos) << v;
}

}  // namespace
}  // namespace twobp
