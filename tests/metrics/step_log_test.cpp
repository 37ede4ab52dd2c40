// A training run's steps as programs report them (twobp/metrics/step_log.h), and bytes for people
// (twobp/metrics/units.h).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "twobp/error.h"
#include "twobp/metrics/step_log.h"
#include "twobp/metrics/units.h"

namespace twobp::testing {
namespace {

using metrics::StepRecord;

StepRecord record(int step, double loss, double tokens_per_s) {
  StepRecord r;
  r.step = step;
  r.loss = loss;
  r.tokens_per_s = tokens_per_s;
  r.grad_norm = 0.5;
  r.lr = 1e-3;
  r.peak_memory_bytes = 3.0 * 1024 * 1024;
  return r;
}

TEST(FormatStep, SaysWhatTheStepMeasured) {
  StepRecord r = record(2, 4.25, 1000);
  EXPECT_EQ(metrics::format_step(r, 20, 1.5, 8.5, 0),
            "step     3/20 | loss 4.2500 | grad norm 0.500 | lr 1.00e-03 | 1000 tok/s | peak 3.0 MiB | elapsed 1.5s | "
            "remaining 8.5s");
  r.skipped = true;
  r.eval_loss = std::log(2.0);
  r.memory_limit_held = false;
  r.j_per_token = 0.25;
  EXPECT_EQ(metrics::format_step(r, 20, 1.5, 8.5, 2.0 * 1024 * 1024),
            "step     3/20 | loss 4.2500 | update skipped (non-finite) | val loss 0.6931 (ppl 2.00) | grad norm 0.500 "
            "| lr 1.00e-03 | 1000 tok/s | peak 3.0 MiB (over the 2 MiB limit) | 0.25 J/tok | elapsed 1.5s | "
            "remaining 8.5s");
  r.peak_memory_bytes = -1;
  EXPECT_NE(metrics::format_step(r, 20, 1, 1, 0).find("peak n/a (rank threads share the GPU)"), std::string::npos);
}

TEST(FormatProgress, EstimatesTheRestFromTheMeanOfTheItemsDone) {
  EXPECT_EQ(metrics::format_progress("configuration", 1, 4, 0.0), "configuration 1/4 | elapsed 0.0s | remaining ?");
  // 2 done in 20 s: 10 s each, 2 left.
  EXPECT_EQ(metrics::format_progress("configuration", 3, 4, 20.0),
            "configuration 3/4 | elapsed 20.0s | remaining ~20.0s");
  EXPECT_EQ(metrics::format_progress("run", 4, 4, 30.0), "run 4/4 | elapsed 30.0s | remaining ~10.0s");
  EXPECT_THROW(metrics::format_progress("run", 0, 4, 0.0), UsageError);
  EXPECT_THROW(metrics::format_progress("run", 5, 4, 0.0), UsageError);
}

TEST(SummarizeSteps, GivesTheFinalMeanAndUpperMedianAndTheMemoryLimitsHeld) {
  EXPECT_TRUE(metrics::summarize_steps({}, 1.0).empty());
  std::vector<StepRecord> records{record(4, 3.0, 100), record(5, 2.0, 300), record(6, 1.0, 200)};
  EXPECT_EQ(metrics::summarize_steps(records, 2.0),
            (std::vector<std::string>{"done: 3 steps (to step 7) in 2.0 s | final loss 1.0000 | mean loss 2.0000 | "
                                      "median 200 tok/s"}));
  records[0].memory_limit_held = true;
  records[1].memory_limit_held = false;
  const std::vector<std::string> lines = metrics::summarize_steps(records, 2.0);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1], "memory limit held on 1 of 2 steps");
}

TEST(StepsJson, HoldsEveryFieldAndNullForWhatWasNotMeasured) {
  StepRecord measured = record(0, 2.0, 10);
  measured.energy_j = 4.0;
  measured.j_per_token = 0.5;
  measured.eval_loss = 1.0;
  measured.skipped = true;
  measured.memory_limit_held = true;
  const auto j = nlohmann::json::parse(metrics::steps_json({record(1, 3.0, 20), measured}));
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["step"], 1);
  EXPECT_EQ(j[0]["loss"], 3.0);
  EXPECT_EQ(j[0]["tokens_per_s"], 20.0);
  EXPECT_EQ(j[0]["grad_norm"], 0.5);
  EXPECT_EQ(j[0]["lr"], 1e-3);
  EXPECT_EQ(j[0]["peak_memory_bytes"], 3.0 * 1024 * 1024);
  EXPECT_TRUE(j[0]["energy_j"].is_null() && j[0]["j_per_token"].is_null());
  EXPECT_FALSE(j[0].contains("skipped") || j[0].contains("eval_loss") || j[0].contains("memory_limit_held"));
  EXPECT_EQ(j[1]["energy_j"], 4.0);
  EXPECT_EQ(j[1]["j_per_token"], 0.5);
  EXPECT_EQ(j[1]["skipped"], true);
  EXPECT_EQ(j[1]["memory_limit_held"], true);
  EXPECT_EQ(j[1]["eval_loss"], 1.0);
  EXPECT_DOUBLE_EQ(j[1]["eval_perplexity"].get<double>(), std::exp(1.0));
}

TEST(HumanBytes, UsesTheLargestBinaryUnitThatLeavesOne) {
  EXPECT_EQ(metrics::human_bytes(0), "0.00 B");
  EXPECT_EQ(metrics::human_bytes(1023), "1023.00 B");
  EXPECT_EQ(metrics::human_bytes(1536), "1.50 KiB");
  EXPECT_EQ(metrics::human_bytes(3.0 * 1024 * 1024 * 1024), "3.00 GiB");
  EXPECT_EQ(metrics::human_bytes(2048.0 * 1024 * 1024 * 1024 * 1024), "2048.00 TiB");
}

}  // namespace
}  // namespace twobp::testing
