// Traces as users get them: gathered from every rank, written as Chrome trace JSON and as an SVG timeline.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mutex>
#include <string>
#include <vector>

#include "twobp/runtime/launch.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/local.h"

namespace twobp {
namespace {

// A trace whose events use every field, different per rank (and of different lengths).
Trace made_up_trace(int rank) {
  Trace t;
  t.step_us = 1000.0 + rank;
  for (int k = 0; k <= rank + 1; ++k) {
    TraceEvent e;
    e.rank = rank;
    e.action.type = k % 2 ? ActionType::kBackwardWeight : ActionType::kForward;
    e.action.stage = rank + 4 * (k % 2);
    e.action.micro_batches = k % 2 ? std::vector<int>{k, k + 3, 7} : std::vector<int>{k};  // not consecutive
    e.action.overlapped_with_next = k == 0;
    e.start_us = 10.5 * k + rank;
    e.end_us = e.start_us + 7.25;
    e.recompute_us = k == 1 ? 2.5 : 0.0;
    e.memory_before = 1000 * k;
    e.memory_after = k == 2 ? -1 : 1000 * k + 17;
    e.memory_peak = (int64_t{1} << 40) + k;  // large byte counts survive the doubles exactly
    t.events.push_back(e);
  }
  return t;
}

void expect_same(const Trace& a, const Trace& b) {
  EXPECT_EQ(a.step_us, b.step_us);
  ASSERT_EQ(a.events.size(), b.events.size());
  for (std::size_t k = 0; k < a.events.size(); ++k) {
    const TraceEvent &x = a.events[k], &y = b.events[k];
    EXPECT_EQ(x.rank, y.rank);
    EXPECT_EQ(x.action, y.action) << describe(x.action) << " vs " << describe(y.action);
    EXPECT_EQ(x.start_us, y.start_us);
    EXPECT_EQ(x.end_us, y.end_us);
    EXPECT_EQ(x.recompute_us, y.recompute_us);
    EXPECT_EQ(x.memory_before, y.memory_before);
    EXPECT_EQ(x.memory_after, y.memory_after);
    EXPECT_EQ(x.memory_peak, y.memory_peak);
  }
}

TEST(Trace, GatherGivesEveryRankEveryTraceWhole) {
  constexpr int kRanks = 3;
  auto transports = make_local_transports(kRanks);
  std::mutex mutex;
  std::vector<std::vector<Trace>> got(kRanks);
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    auto all = gather_traces(t, made_up_trace(t.rank()), std::chrono::seconds(30));
    std::lock_guard<std::mutex> lock(mutex);
    got[t.rank()] = std::move(all);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(got[r].size(), static_cast<std::size_t>(kRanks)) << "rank " << r;
    for (int from = 0; from < kRanks; ++from) expect_same(got[r][from], made_up_trace(from));
  }
}

TEST(Trace, ChromeTraceNamesOneTrackPerRank) {
  const std::vector<Trace> ranks{made_up_trace(0), made_up_trace(1), made_up_trace(2)};
  const auto json = nlohmann::json::parse(to_chrome_trace(ranks));
  std::vector<std::string> names(3);
  int slices = 0, recomputes = 0;
  for (const auto& e : json["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") names.at(e["tid"].get<int>()) = e["args"]["name"];
    if (e["ph"] == "X") {
      const int tid = e["tid"];
      ASSERT_GE(tid, 0);
      ASSERT_LT(tid, 3);
      (e["cat"] == "recompute" ? recomputes : slices) += 1;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"rank 0", "rank 1", "rank 2"}));
  EXPECT_EQ(slices, 2 + 3 + 4);
  EXPECT_EQ(recomputes, 3);  // event 1 of each rank
}

TEST(Trace, SvgHasATimeAxisShadesLaterChunksAndEscapesTheTitle) {
  const std::vector<Trace> ranks{made_up_trace(0), made_up_trace(1)};
  const std::string svg = to_svg(ranks, "zb-v <p=2> & m=4");
  EXPECT_NE(svg.find("zb-v &lt;p=2&gt; &amp; m=4"), std::string::npos);
  EXPECT_EQ(svg.find("<p=2>"), std::string::npos);
  EXPECT_NE(svg.find("time (ms)"), std::string::npos);
  // Step 1.001 ms: ticks every 0.2 ms from 0 to 1.
  for (const char* tick : {">0<", ">0.2<", ">0.4<", ">1<"}) EXPECT_NE(svg.find(tick), std::string::npos) << tick;
  // Every rank has two chunks (stages r and r + 4): the later one is drawn lighter, and the legend says so.
  EXPECT_NE(svg.find("fill-opacity=\"1.00\""), std::string::npos);
  EXPECT_NE(svg.find("fill-opacity=\"0.65\""), std::string::npos);
  EXPECT_NE(svg.find("later chunks"), std::string::npos);
  const std::string one_chunk = to_svg({Trace{}}, "t");
  EXPECT_EQ(one_chunk.find("later chunks"), std::string::npos);
}

}  // namespace
}  // namespace twobp
