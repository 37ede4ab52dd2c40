// A LLaMa run's sizes and memory per rank from formulas (twobp/plan/llama_memory.h): the report holds what
// models::estimate_memory says, per stage and per rank, and judges a budget.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "twobp/plan/llama_memory.h"
#include "twobp/schedule/registry.h"

namespace twobp::testing {
namespace {

TEST(LlamaMemoryReport, HoldsTheEstimatesPerStageAndRankAndJudgesABudget) {
  const models::LlamaConfig config = models::config_by_name("tiny");
  const Schedule schedule = make_schedule("interleaved-1f1b", ScheduleOptions{2, 4, 2, BackwardMode::kSplit});
  const models::Partition partition = models::make_partition(config, 4, 32);
  models::MemoryPlanOptions mo;
  mo.micro_batch_size = 2;
  mo.seq_len = 32;
  mo.precision = models::training_precision(Precision::kFloat32);
  mo.recompute = true;
  mo.recompute_ranks = {1};
  const std::vector<models::RankMemoryEstimate> expected = models::estimate_memory(config, partition, schedule, mo);

  const LlamaMemoryReport unjudged = llama_memory_report(config, partition, schedule, mo);
  EXPECT_TRUE(unjudged.fits);
  const auto u = nlohmann::json::parse(unjudged.json);
  EXPECT_FALSE(u.contains("fits") || u.contains("gpu_memory_gb") || u["ranks"][0].contains("fits"));
  EXPECT_EQ(u["parameters"], models::parameter_count(config));
  EXPECT_EQ(u["recompute"], true);
  EXPECT_EQ(u["recompute_ranks"], std::vector<int>{1});
  EXPECT_EQ(u["precision"], "fp32");
  ASSERT_EQ(u["stages"].size(), 4u);
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(u["stages"][s]["rank"], schedule.stage_to_rank[s]);
    EXPECT_EQ(u["stages"][s]["parameters"], models::chunk_parameter_count(config, partition.chunks[s]));
  }
  ASSERT_EQ(u["ranks"].size(), 2u);
  ASSERT_EQ(unjudged.lines.size(), 3u);  // the run, then one line per rank
  EXPECT_NE(unjudged.lines[0].find("model tiny:"), std::string::npos) << unjudged.lines[0];
  EXPECT_NE(unjudged.lines[0].find("recompute on rank 1"), std::string::npos) << unjudged.lines[0];
  for (int r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(u["ranks"][r]["memory_bytes"].get<double>(), expected[r].total);
    EXPECT_DOUBLE_EQ(u["ranks"][r]["activation_bytes"].get<double>(), expected[r].activations);
    EXPECT_NE(unjudged.lines[1 + r].find(fmt::format("  rank {}: stages ", r)), std::string::npos);
  }

  // A budget between the two ranks' totals: one fits, the other does not, and the run does not.
  const double budget = std::min(expected[0].total, expected[1].total);
  const LlamaMemoryReport judged = llama_memory_report(config, partition, schedule, mo, budget);
  EXPECT_FALSE(judged.fits || expected[0].total == expected[1].total);
  const auto j = nlohmann::json::parse(judged.json);
  EXPECT_EQ(j["fits"], judged.fits);
  EXPECT_DOUBLE_EQ(j["gpu_memory_gb"].get<double>(), budget / (1024.0 * 1024.0 * 1024.0));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(j["ranks"][r]["fits"], expected[r].total <= budget);
  const LlamaMemoryReport roomy = llama_memory_report(config, partition, schedule, mo, 2 * budget + 1e12);
  EXPECT_TRUE(roomy.fits);
  EXPECT_NE(roomy.lines[1].find("(fits "), std::string::npos) << roomy.lines[1];
}

}  // namespace
}  // namespace twobp::testing
