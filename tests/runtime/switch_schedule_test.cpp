// Pipeline::switch_schedule: after a step with one schedule, the next steps run another of the same placement and
// still give the single-process gradients (float64, every parameter); hooks and evaluation follow the switch; what
// cannot be switched to is refused before anything changes. Data parallelism and mixed precision across a switch:
// data_parallel_test (SwitchedDataPipelineParity).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "common/pairing_schedule.h"
#include "common/pipeline_fixtures.h"
#include "common/switch_pairs.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

// Every rank's pipeline of `schedule` over Local transports, the chunks built on this thread (the global generator
// is not thread-safe) as run_reference builds them; `chunks[s]` is stage s's module.
struct Job {
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;
  std::vector<Transport*> transports;
};

Job make_job(const Schedule& schedule, Pairing pairing = Pairing::kByTag, bool recompute = false) {
  LocalOptions lo;
  lo.pairing = pairing;
  auto transports = make_local_transports(schedule.num_ranks, lo);
  Job job;
  job.chunks.resize(static_cast<std::size_t>(schedule.num_stages));
  for (int r = 0; r < schedule.num_ranks; ++r) {
    std::vector<PipelineChunk> chunks;
    for (int s : schedule.stages_of(r)) {
      auto module = make_chunk(s);
      job.chunks[s] = module;
      auto* raw = module.get();
      chunks.push_back({s, module, [raw, s](const at::Tensor& x) { return run_chunk(*raw, s, x); }, recompute});
    }
    job.pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks),
                                                       std::shared_ptr<Transport>(std::move(transports[r])),
                                                       fixture_options()));
    job.transports.push_back(&job.pipelines.back()->transport());
  }
  return job;
}

struct SwitchCase {
  ScheduleForm from, to;
  int p = 2, m = 4;
  Pairing pairing = Pairing::kByTag;
  bool recompute = false;
};

class SwitchParity : public ::testing::TestWithParam<SwitchCase> {
 protected:
  Float64Default float64_;
};

// One step with `from`, zero_grad, switch to `to` on every rank, one step: the second step's losses and every
// parameter's gradient are those of loss.backward() in one process, a hook added before the switch runs once per
// action of the new lists, and evaluate() after the switch gives the batch's loss without touching gradients.
TEST_P(SwitchParity, StepsAfterTheSwitchMatchSingleProcess) {
  const SwitchCase& c = GetParam();
  torch::manual_seed(1);
  const auto inputs = torch::randn({c.m * kMicroBatchSize, kDim});
  const auto targets = torch::randn({c.m * kMicroBatchSize, kDim});
  const Reference ref = run_reference(c.from.schedule.num_stages, c.m, inputs, targets);
  Job job = make_job(c.from.schedule, c.pairing, c.recompute);
  const int p = c.from.schedule.num_ranks;
  std::vector<std::atomic<int>> after_switch(static_cast<std::size_t>(p));
  std::vector<std::atomic<bool>> switched(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    job.pipelines[r]->add_hook([&, r](const ActionEvent&) {
      if (switched[r]) ++after_switch[r];
    });
  }
  std::vector<StepResult> results(static_cast<std::size_t>(p));
  std::vector<double> eval_losses(static_cast<std::size_t>(p));
  run_rank_threads(job.transports, [&](Transport& t) {
    Pipeline& pipeline = *job.pipelines[t.rank()];
    pipeline.step(inputs, targets);
    pipeline.zero_grad();
    pipeline.switch_schedule(c.to.schedule);
    switched[t.rank()] = true;
    results[t.rank()] = pipeline.step(inputs, targets);
    eval_losses[t.rank()] = pipeline.evaluate(inputs, targets);
  }).rethrow_root_cause();

  double ref_mean = 0.0;
  for (double l : ref.losses) ref_mean += l / static_cast<double>(ref.losses.size());
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(job.pipelines[r]->schedule().name, c.to.schedule.name);
    // Every action of the new list ran through the hook of before the switch, once (evaluation runs no hooks).
    EXPECT_EQ(after_switch[r].load(), static_cast<int>(job.pipelines[r]->schedule().actions[r].size()))
        << "rank " << r;
    EXPECT_NEAR(eval_losses[r], ref_mean, 1e-12 * std::abs(ref_mean)) << "rank " << r;
  }
  const int last = c.to.schedule.stage_to_rank.back();
  ASSERT_EQ(results[last].losses.size(), static_cast<std::size_t>(c.m));
  for (int mb = 0; mb < c.m; ++mb) EXPECT_NEAR(results[last].losses[mb], ref.losses[mb], 1e-12) << "mb " << mb;
  for (int s = 0; s < c.to.schedule.num_stages; ++s) {
    auto got = job.chunks[s]->named_parameters();
    for (const auto& item : ref.chunks[s]->named_parameters()) {
      const at::Tensor& g = got[item.key()].grad();
      ASSERT_TRUE(g.defined()) << "stage " << s << " " << item.key() << " has no gradient";
      EXPECT_LE((g - item.value().grad()).abs().max().item<double>(), 1e-12) << "stage " << s << " " << item.key();
    }
  }
}

std::vector<SwitchCase> switch_cases() {
  std::vector<SwitchCase> out;
  // m = 6 at p = 4: not a multiple of p.
  for (auto [p, m] : std::vector<std::pair<int, int>>{{2, 4}, {4, 8}, {4, 6}}) {
    for (const auto& [from, to] : switch_pairs(p, m)) {
      out.push_back({from, to, p, m});
      // In-order pairing (as NCCL pairs) and recomputation, at one shape.
      if (p == 2) {
        out.push_back({from, to, p, m, Pairing::kInOrderPerChannel});
        out.push_back({from, to, p, m, Pairing::kByTag, true});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(SamePlacement, SwitchParity, ::testing::ValuesIn(switch_cases()), [](const auto& info) {
  const SwitchCase& c = info.param;
  std::string n = c.from.label() + "_to_" + c.to.label() + "_p" + std::to_string(c.p) + "_m" + std::to_string(c.m) +
                  (c.pairing == Pairing::kByTag ? "" : "_in_order") + (c.recompute ? "_recompute" : "");
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

// Refusals leave the running schedule in place: the pipeline still steps with it afterwards.
TEST(SwitchSchedule, WhatCannotBeSwitchedToIsRefusedAndTheRunningScheduleStays) {
  Float64Default float64;
  // Stages placed 0, 1, 0, 1 on a transport that pairs in order, as NCCL does.
  const Schedule running = make_schedule("interleaved-1f1b", ScheduleOptions{2, 2, 2, BackwardMode::kStandard});
  Job job = make_job(running, Pairing::kInOrderPerChannel);
  // usage: refused with a UsageError that is not a ScheduleError (placement, micro-batches).
  auto expect_refused = [&](const Schedule& next, const std::string& needle, bool usage) {
    for (int r = 0; r < 2; ++r) {
      try {
        job.pipelines[r]->switch_schedule(next);
        ADD_FAILURE() << "switch to " << next.name << " accepted";
      } catch (const ScheduleError& e) {  // a UsageError too: caught first
        EXPECT_FALSE(usage) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      } catch (const UsageError& e) {
        EXPECT_TRUE(usage) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
      EXPECT_EQ(job.pipelines[r]->schedule().name, running.name);
    }
  };
  // Another placement (the V: 0, 1, 1, 0), another micro-batch count, a list of the same placement that the
  // in-order transport cannot pair (common/pairing_schedule.h).
  expect_refused(make_schedule("zb-v", ScheduleOptions{2, 2, 2, BackwardMode::kSplit}), "placement", true);
  expect_refused(make_schedule("interleaved-1f1b", ScheduleOptions{2, 4, 2, BackwardMode::kSplit}), "micro-batches",
                 true);
  expect_refused(breadth_first_vs_depth_first(), "", false);
  torch::manual_seed(1);
  const auto inputs = torch::randn({2 * kMicroBatchSize, kDim});
  const auto targets = torch::randn({2 * kMicroBatchSize, kDim});
  const Reference ref = run_reference(4, 2, inputs, targets);
  std::vector<StepResult> results(2);
  run_rank_threads(job.transports, [&](Transport& t) {
    results[t.rank()] = job.pipelines[t.rank()]->step(inputs, targets);
  }).rethrow_root_cause();
  ASSERT_EQ(results[1].losses.size(), 2u);
  for (int mb = 0; mb < 2; ++mb) EXPECT_NEAR(results[1].losses[mb], ref.losses[mb], 1e-12);
}

}  // namespace
}  // namespace twobp::testing
