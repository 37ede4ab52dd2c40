// The schedule chosen at run time (twobp/plan/choose.h): the ranking is the simulator's under the measured costs,
// over exactly the schedules a running pipeline can switch to; AutoSchedule decides alike on every rank, switches
// at step boundaries, and the steps around its switches keep the single-process gradients (float64).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/plan/choose.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

MeasuredCosts split_costs(int stages, double f, double i, double w) {
  MeasuredCosts c;
  c.forward.assign(stages, f);
  c.backward_input.assign(stages, i);
  c.backward_weight.assign(stages, w);
  c.backward.assign(stages, 0.0);
  return c;
}

TEST(RankSchedules, AreTheSimulatorsStepTimesOverTheSchedulesOfTheRunningPlacement) {
  for (const auto& [start, v] : std::vector<std::pair<std::string, int>>{{"1f1b", 1}, {"interleaved-1f1b", 2},
                                                                         {"zb-v", 2}}) {
    const Schedule running = make_schedule(start, ScheduleOptions{2, 4, v, BackwardMode::kSplit});
    MeasuredCosts costs = split_costs(running.num_stages, 1.0, 1.25, 0.75);
    costs.communication = 0.1;
    const std::vector<ScheduleCandidate> ranking = rank_schedules(running, costs);
    ASSERT_GE(ranking.size(), 2u) << start;  // at least the running schedule's two forms
    bool has_running = false;
    for (std::size_t k = 0; k < ranking.size(); ++k) {
      const ScheduleCandidate& c = ranking[k];
      SCOPED_TRACE(start + " candidate " + c.name);
      EXPECT_EQ(c.schedule.stage_to_rank, running.stage_to_rank);
      EXPECT_EQ(c.schedule.num_micro_batches, running.num_micro_batches);
      EXPECT_EQ(c.schedule.backward, c.mode);
      if (k > 0) EXPECT_LE(ranking[k - 1].predicted_ms, c.predicted_ms);
      // The same prediction from the costs written out by hand: a fused B costs I + W.
      CostModel model = CostModel::uniform(running.num_stages, 1.0, 1.25, 0.75, 0.1);
      model.backward.assign(running.num_stages, 2.0);
      if (c.mode == BackwardMode::kStandard) {
        model.backward_input.assign(running.num_stages, 0.0);
        model.backward_weight.assign(running.num_stages, 0.0);
      }
      EXPECT_DOUBLE_EQ(c.predicted_ms, simulate(c.schedule, model).step_time);
      has_running = has_running || (c.name == start && c.mode == BackwardMode::kSplit);
    }
    EXPECT_TRUE(has_running) << start;
    // Every registered schedule of this placement is there, in both forms (none is rejected at p = 2, m = 4).
    int expected = 0;
    for (const std::string& name : schedule_names()) {
      for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
        try {
          const Schedule sc = make_schedule(name, ScheduleOptions{2, 4, v, mode});
          expected += sc.stage_to_rank == running.stage_to_rank;
        } catch (const UsageError&) {
        }
      }
    }
    EXPECT_EQ(static_cast<int>(ranking.size()), expected) << start;
  }
}

TEST(RankSchedules, CostsOfAStandardRunRankOnlyStandardFormsAndNamesFilter) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kStandard});
  MeasuredCosts costs = split_costs(2, 1.0, 0.0, 0.0);
  costs.backward = {2.0, 2.0};
  const auto ranking = rank_schedules(running, costs);
  ASSERT_FALSE(ranking.empty());
  for (const auto& c : ranking) EXPECT_EQ(c.mode, BackwardMode::kStandard) << c.name;
  const auto only = rank_schedules(running, split_costs(2, 1.0, 1.0, 1.0), {"zb-h1"}, {BackwardMode::kSplit});
  ASSERT_EQ(only.size(), 1u);
  EXPECT_EQ(only[0].name, "zb-h1");
  EXPECT_THROW(rank_schedules(running, split_costs(3, 1.0, 1.0, 1.0)), UsageError);  // costs of other stages
}

// AutoSchedule on 2 rank threads: whatever the machine's timings make it choose, every rank prints the same
// decisions at the same steps, the pipeline runs the announced schedule after each, and every step's gradients
// (no optimizer: the weights stay) are the single-process ones.
TEST(AutoSchedule, DecidesAlikeOnEveryRankAndKeepsTheGradients) {
  Float64Default float64;
  constexpr int kSteps = 9, kMicroBatches = 4;
  const Schedule start = make_schedule("gpipe", ScheduleOptions{2, kMicroBatches, 1, BackwardMode::kSplit});
  torch::manual_seed(1);
  const auto inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const auto targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const Reference ref = run_reference(2, kMicroBatches, inputs, targets);
  auto transports = make_local_transports(2);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  std::vector<std::shared_ptr<torch::nn::Module>> modules(2);
  std::vector<Transport*> ts;
  for (int r = 0; r < 2; ++r) {
    modules[r] = make_chunk(r);
    auto* raw = modules[r].get();
    std::vector<PipelineChunk> chunks;
    chunks.push_back({r, modules[r], [raw, r](const at::Tensor& x) { return run_chunk(*raw, r, x); }});
    pipelines.push_back(std::make_unique<Pipeline>(start, std::move(chunks),
                                                   std::shared_ptr<Transport>(std::move(transports[r])),
                                                   fixture_options()));
    ts.push_back(&pipelines[r]->transport());
  }
  std::vector<std::vector<std::pair<int, std::string>>> news(2);     // (step, line) per rank
  std::vector<std::vector<std::string>> schedule_at(2);              // schedule name after each step
  std::vector<std::vector<std::string>> mismatches(2);
  std::mutex mutex;
  run_rank_threads(ts, [&](Transport& t) {
    const int r = t.rank();
    Pipeline& pipeline = *pipelines[r];
    AutoScheduleOptions o;
    o.probe_steps = 3;
    o.verify_steps = 3;
    AutoSchedule chooser(pipeline, o);
    for (int step = 0; step < kSteps; ++step) {
      pipeline.zero_grad();
      const StepResult result = pipeline.step(inputs, targets);
      std::string bad;
      for (const auto& item : ref.chunks[r]->named_parameters()) {
        const at::Tensor g = modules[r]->named_parameters()[item.key()].grad();
        if (!g.defined() || (g - item.value().grad()).abs().max().item<double>() > 1e-12) {
          bad = "step " + std::to_string(step) + " " + item.key();
        }
      }
      std::optional<std::string> line = chooser.after_step(result);
      std::lock_guard<std::mutex> lock(mutex);
      if (!bad.empty()) mismatches[r].push_back(bad);
      if (line) news[r].emplace_back(step, *line);
      schedule_at[r].push_back(pipeline.schedule().name + (pipeline.schedule().backward == BackwardMode::kSplit
                                                               ? " 2bp"
                                                               : " standard"));
    }
    EXPECT_EQ(chooser.phase(), AutoSchedule::Phase::kDone);
  }).rethrow_root_cause();
  EXPECT_TRUE(mismatches[0].empty() && mismatches[1].empty())
      << (mismatches[0].empty() ? mismatches[1].front() : mismatches[0].front());
  EXPECT_EQ(news[0], news[1]);
  EXPECT_EQ(schedule_at[0], schedule_at[1]);
  // The first decision ends the probe (step index probe_steps - 1); a switch is followed by a verdict
  // verify_steps later. The schedule changes only at those steps.
  ASSERT_FALSE(news[0].empty());
  EXPECT_EQ(news[0][0].first, 2);
  for (int step = 0; step < 2; ++step) EXPECT_EQ(schedule_at[0][step], "gpipe 2bp");
  if (news[0][0].second.find("switching to") != std::string::npos) {
    ASSERT_EQ(news[0].size(), 2u) << news[0][0].second;
    EXPECT_EQ(news[0][1].first, 5);
    EXPECT_NE(schedule_at[0][2], "gpipe 2bp");
    const bool back = news[0][1].second.find("back to") != std::string::npos;
    EXPECT_EQ(schedule_at[0][5] == "gpipe 2bp", back) << news[0][1].second;
    for (int step = 6; step < kSteps; ++step) EXPECT_EQ(schedule_at[0][step], schedule_at[0][5]);
  } else {
    EXPECT_EQ(news[0].size(), 1u);
    for (const auto& s : schedule_at[0]) EXPECT_EQ(s, "gpipe 2bp");
  }
}

TEST(AutoSchedule, RefusesBadOptionsAndMemoryBoundPipelines) {
  Float64Default float64;
  const Schedule sc = make_schedule("1f1b", ScheduleOptions{1, 2, 1, BackwardMode::kSplit});
  auto make = [&](PipelineOptions o) {
    auto module = make_chunk(0);
    auto* raw = module.get();
    std::vector<PipelineChunk> chunks;
    chunks.push_back({0, module, [raw](const at::Tensor& x) { return run_chunk(*raw, 0, x); }});
    return std::make_unique<Pipeline>(sc, std::move(chunks), std::shared_ptr<Transport>(std::move(make_local_transports(1)[0])),
                                      o);
  };
  auto plain = make(fixture_options());
  AutoScheduleOptions one_probe;
  one_probe.probe_steps = 1;
  EXPECT_THROW(AutoSchedule(*plain, one_probe), UsageError);
  PipelineOptions bounded = fixture_options();
  bounded.max_pending_weight_micro_batches = 1;
  auto limited = make(bounded);
  try {
    AutoSchedule chooser(*limited, AutoScheduleOptions{});
    ADD_FAILURE() << "a memory-bound pipeline was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("memory"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace twobp::testing
