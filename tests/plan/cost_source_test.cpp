// CostSource and add_data_parallel (twobp/plan/cost_source.h): per-rank constants split over a rank's chunks, a
// run document's costs on its own and on other placements with the partner's mode, the ring all-reduce terms.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/expect_error.h"
#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/plan/cost_source.h"
#include "twobp/schedule/registry.h"

namespace twobp {
namespace {

Schedule schedule(const std::string& name, int p, int m, int v, BackwardMode mode = BackwardMode::kSplit) {
  return make_schedule(name, ScheduleOptions{p, m, v, mode});
}

// The standard-mode result of the same run as `split` (2 stages): fused B costs, no I or W.
RunRecord standard_partner(const RunRecord& split) {
  RunRecord standard = split;
  standard.mode = BackwardMode::kStandard;
  standard.costs.backward_input = {0.0, 0.0};
  standard.costs.backward_weight = {0.0, 0.0};
  standard.costs.backward = {3.5, 6.5};
  return standard;
}

TEST(CostSource, PerRankCostsAreSplitOverARanksChunks) {
  const CostSource src(RankCosts{4.0, 6.0, 2.0, 8.0, 1.0, 0.5}, 0.25);
  EXPECT_FALSE(src.measured());
  for (const auto& [name, v] : std::vector<std::pair<std::string, int>>{{"1f1b", 1}, {"zb-v", 2}, {"interleaved-1f1b", 3}}) {
    const Schedule sc = schedule(name, 3, 6, v);
    std::string rule;
    const CostModel c = src.costs_for(sc, /*recompute=*/true, &rule);
    EXPECT_EQ(rule, "per-rank / v");
    ASSERT_EQ(c.forward.size(), static_cast<std::size_t>(3 * v)) << name;
    for (int s = 0; s < sc.num_stages; ++s) {
      EXPECT_DOUBLE_EQ(c.forward[s], 4.0 / v);
      EXPECT_DOUBLE_EQ(c.backward_input[s], 6.0 / v);
      EXPECT_DOUBLE_EQ(c.backward_weight[s], 2.0 / v);
      EXPECT_DOUBLE_EQ(c.backward[s], 8.0 / v);
      EXPECT_DOUBLE_EQ(c.backward_weight_fixed[s], 1.0 / v);
      EXPECT_DOUBLE_EQ(c.recompute[s], c.forward[s]) << "a recomputation re-runs the forward";
    }
    EXPECT_DOUBLE_EQ(c.communication, 0.5);
    EXPECT_DOUBLE_EQ(c.overlap, 0.25);
    EXPECT_TRUE(src.costs_for(sc).recompute.empty());
  }
  EXPECT_NE(src.description().find("F=4 I=6 W=2 B=8 W0=1 comm=0.5 overlap=0.25"), std::string::npos)
      << src.description();
  EXPECT_THROW(CostSource(RankCosts{-1.0}), UsageError);
  EXPECT_THROW(CostSource(RankCosts{}, 1.5), UsageError);
}

// A 2BP result and its standard partner of the same placement: each result's costs complete with the other's
// mode; on the same placement every stage keeps its cost, on other ranks the mean rank's total / v.
TEST(CostSource, ARunDocumentsResultWithItsPartnersMode) {
  RunDocument doc;
  RunRecord split{"1f1b", BackwardMode::kSplit, 2, 4, 1};
  split.costs.forward = {1.0, 3.0};
  split.costs.backward_input = {2.0, 4.0};
  split.costs.backward_weight = {1.0, 2.0};
  split.costs.backward = {0.0, 0.0};
  split.costs.communication = 0.2;
  const RunRecord standard = standard_partner(split);
  doc.results = {split, standard};
  for (std::size_t index : {0u, 1u}) {
    const CostSource src(doc, index, "run.json");
    EXPECT_TRUE(src.measured());
    EXPECT_NE(src.description().find("run.json result " + std::to_string(index)), std::string::npos);
    std::string rule;
    const CostModel same = src.costs_for(schedule("1f1b", 2, 8, 1), false, &rule);
    EXPECT_EQ(rule, "per-stage");
    EXPECT_EQ(same.forward, (std::vector<double>{1.0, 3.0}));
    EXPECT_EQ(same.backward_input, (std::vector<double>{2.0, 4.0})) << "result " << index;
    EXPECT_EQ(same.backward, (std::vector<double>{3.5, 6.5})) << "result " << index;
    EXPECT_DOUBLE_EQ(same.communication, 0.2);
    const CostModel wider = src.costs_for(schedule("zb-v", 4, 8, 2), false, &rule);
    EXPECT_EQ(rule, "mean-rank / v");
    for (double f : wider.forward) EXPECT_DOUBLE_EQ(f, (1.0 + 3.0) / 2 / 2);
  }
  EXPECT_DOUBLE_EQ(CostSource(doc, 0, "run.json", 0.75).costs_for(schedule("1f1b", 2, 4, 1)).overlap, 0.75);
  try {
    CostSource(doc, 2, "run.json");
    ADD_FAILURE() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("run.json: result 2 out of range"), std::string::npos) << e.what();
  }
  doc.results[0].v = 2;  // 4 stages, 2 costs
  EXPECT_THROW(CostSource(doc, 0, "run.json"), UsageError);
}

// Issue 69: each per-rank cost NaN, +inf, -inf, negative or past 1e9 ms is refused naming it; so is a B more than
// 10 % below max(I, W0 + W) -- `twobp_bench simulate --b 0.5 --i 1 --w 1` -- while B = max(I, W) less 10 % is taken.
TEST(CostSource, RefusesPerRankCostsThatAreNotCosts) {
  using Field = double RankCosts::*;
  const std::pair<const char*, Field> fields[] = {{"F (RankCosts.forward)", &RankCosts::forward},
                                                  {"I (RankCosts.backward_input)", &RankCosts::backward_input},
                                                  {"W (RankCosts.backward_weight)", &RankCosts::backward_weight},
                                                  {"B (RankCosts.backward)", &RankCosts::backward},
                                                  {"W0 (RankCosts.backward_weight_fixed)",
                                                   &RankCosts::backward_weight_fixed},
                                                  {"comm (RankCosts.communication)", &RankCosts::communication}};
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto& [name, field] : fields) {
    for (double bad : {std::nan(""), inf, -inf, -1.0, 1e308}) {
      RankCosts c;
      c.*field = bad;
      testing::expect_error([&] { CostSource src(c); }, {std::string("CostSource: per-rank costs: ") + name + " is "});
    }
  }
  testing::expect_error([] { CostSource src(RankCosts{1.0, 1.0, 1.0, 0.5}); },
                        {"B is 0.5, below max(I, W) = max(1, 1)", "10 % tolerance"});
  testing::expect_error([] { CostSource src(RankCosts{1.0, 1.0, 2.0, 1.5}); }, {"B is 1.5, below max(I, W)"});
  testing::expect_error([] { CostSource src(RankCosts{1.0, 1.0, 1.0, 1.5, 1.0}); }, {"max(1, 2)"});  // W0 + W
  EXPECT_NO_THROW(CostSource(RankCosts{1.0, 1.0, 1.0, 0.95}));  // within the tolerance
  EXPECT_NO_THROW(CostSource(RankCosts{1.0, 0.0, 0.0, 0.0}));  // 0: free (or not measured)
  for (double bad : {std::nan(""), inf, -inf, -0.5}) {
    EXPECT_THROW(CostSource(RankCosts{}, bad), UsageError) << "overlap " << bad;
  }
}

// A document built in code (not read) with a cost that is no cost, or lists of other lengths, is refused naming
// the file and the result (CostSource's header); so is an overlap that is not a share.
TEST(CostSource, RefusesARecordsBadCostsNamingTheFileAndResult) {
  const double inf = std::numeric_limits<double>::infinity();
  RunRecord split{"1f1b", BackwardMode::kSplit, 2, 4, 1};
  split.costs.forward = {1.0, 3.0};
  split.costs.backward_input = {2.0, 4.0};
  split.costs.backward_weight = {1.0, 2.0};
  split.costs.backward = {0.0, 0.0};
  for (double bad : {std::nan(""), inf, -inf, -1.0, 1e308}) {
    RunDocument doc;
    doc.results = {split};
    doc.results[0].costs.backward_weight[1] = bad;
    testing::expect_error([&] { CostSource src(doc, 0, "run.json"); }, {"run.json: result 0: costs_ms.W[1] is "});
  }
  RunDocument doc;
  doc.results = {split};
  doc.results[0].costs.backward_input = {2.0, 4.0, 5.0};  // 3 entries, 2 stages
  testing::expect_error([&] { CostSource src(doc, 0, "run.json"); }, {"run.json: result 0:", "sizes differ"});
  const RunRecord standard = standard_partner(split);
  doc.results = {split, standard};
  doc.results[1].costs.backward[0] = std::nan("");
  testing::expect_error([&] { CostSource src(doc, 0, "run.json"); },
                        {"run.json: result 1 (the partner of result 0): costs_ms.B[0] is nan"});
  doc.results = {split};
  EXPECT_THROW(CostSource(doc, 0, "run.json", std::nan("")), UsageError);
  EXPECT_THROW(CostSource(doc, 0, "run.json", inf), UsageError);
}

TEST(AddDataParallel, EachStagesRingAllReduceInBuckets) {
  const Schedule sc = schedule("zb-v", 2, 4, 2);  // stages 0, 3 on rank 0; 1, 2 on rank 1
  const std::vector<double> bytes{1e6, 2e6, 3e6, 4e6};
  const RingLink link{4, 1e9, 5e-6, 3, false};
  CostModel costs = CostModel::uniform(4, 1, 1, 1);
  const double worst = add_data_parallel(costs, sc, bytes, link);
  ASSERT_EQ(costs.data_parallel_reduce.size(), 4u);
  for (int s = 0; s < 4; ++s) {
    EXPECT_DOUBLE_EQ(costs.data_parallel_reduce[s],
                     3 * 1e3 * metrics::ring_all_reduce_seconds(bytes[s] / 3, 4, 1e9, 5e-6))
        << "stage " << s;
  }
  EXPECT_FALSE(costs.overlap_data_parallel);
  EXPECT_EQ(costs.data_parallel_buckets, 3);
  EXPECT_DOUBLE_EQ(worst, costs.data_parallel_reduce[0] + costs.data_parallel_reduce[3]) << "rank 0 holds the most";
  EXPECT_THROW(add_data_parallel(costs, sc, {1e6}, link), UsageError);
  EXPECT_THROW(add_data_parallel(costs, sc, bytes, RingLink{4, 1e9, 0.0, 0}), UsageError);
  // Issue 69: gradient sizes and the link's numbers that are not sizes or times; a bandwidth of 0 means nothing.
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {std::nan(""), inf, -inf, -1.0}) {
    std::vector<double> wrong = bytes;
    wrong[1] = bad;
    testing::expect_error([&] { add_data_parallel(costs, sc, wrong, link); },
                          {"add_data_parallel: gradient_bytes[1] is ", "expected a finite size in bytes >= 0"});
    testing::expect_error([&] { add_data_parallel(costs, sc, bytes, RingLink{4, 1e9, bad, 1}); },
                          {"add_data_parallel: RingLink.latency_s is "});
  }
  for (double bad : {std::nan(""), inf, -inf, -1.0, 0.0}) {
    testing::expect_error([&] { add_data_parallel(costs, sc, bytes, RingLink{4, bad, 0.0, 1}); },
                          {"add_data_parallel: RingLink.bytes_per_s is ", "a finite bandwidth in bytes/s > 0"});
  }
  EXPECT_NO_THROW(add_data_parallel(costs, sc, bytes, RingLink{1, 0.0, 0.0, 1})) << "one replica: no link needed";
  EXPECT_NO_THROW(add_data_parallel(costs, sc, {0.0, 0.0, 0.0, 0.0}, link)) << "0 bytes: nothing to reduce";
}

}  // namespace
}  // namespace twobp
