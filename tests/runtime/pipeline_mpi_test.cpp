// The pipeline parity test through real processes: run under `mpiexec -n P`, one rank per process, MPI
// transport. Every schedule x {standard, 2BP} x two micro-batch counts, and a first stage entirely frozen; each
// rank checks its own chunks' gradients against the single-process reference (which every rank computes).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/mpi_test_env.h"
#include "common/pipeline_fixtures.h"
#include "common/tied_cases.h"
#include "twobp/error.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/mpi.h"

namespace twobp::testing {
namespace {

struct Case {
  std::string schedule;
  BackwardMode mode;
  int m_factor;  // micro-batches = m_factor * world size
  bool frozen_first = false;  // stage 0 entirely frozen: its output carries no gradient (spec says so)
};

class MpiPipelineParity : public ::testing::TestWithParam<Case> {
 protected:
  Float64Default float64_;
};

TEST_P(MpiPipelineParity, LossesAndGradientsMatchSingleProcess) {
  const Case c = GetParam();
  auto& env = *mpitest::g_mpi;
  const int p = env.world_size(), me = env.rank(), m = c.m_factor * p;
  const ScheduleOptions so = default_schedule_options(c.schedule, p, m, c.mode);
  Schedule schedule;
  try {
    schedule = make_schedule(c.schedule, so);
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();  // same decision on every rank
  }
  torch::manual_seed(1);
  auto inputs = torch::randn({m * kMicroBatchSize, kDim});
  auto targets = torch::randn({m * kMicroBatchSize, kDim});
  const int frozen = c.frozen_first ? 1 : 0;
  Reference ref = run_reference(schedule.num_stages, m, inputs, targets, frozen);

  std::vector<PipelineChunk> chunks;
  std::map<int, std::shared_ptr<torch::nn::Module>> mine;
  for (int s : schedule.stages_of(me)) {
    auto module = make_chunk(s, s < frozen);
    mine[s] = module;
    auto* raw = module.get();
    chunks.push_back({s, module, [raw, s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
  }
  PipelineOptions options;
  options.executor.timeout = std::chrono::seconds(60);
  options.loss = mse;
  options.executor.activation_spec = [frozen](int s) {
    return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble, "", /*requires_grad=*/s >= frozen};
  };
  Pipeline pipeline(schedule, std::move(chunks), std::make_shared<MpiTransport>(env), options);
  StepResult result = pipeline.step(inputs, targets);

  if (me == schedule.stage_to_rank.back()) {
    ASSERT_EQ(result.losses.size(), static_cast<std::size_t>(m));
    for (int mb = 0; mb < m; ++mb) EXPECT_NEAR(result.losses[mb], ref.losses[mb], 1e-12) << "micro-batch " << mb;
  }
  for (auto& [s, module] : mine) {
    auto got = module->named_parameters();
    for (const auto& item : ref.chunks[s]->named_parameters()) {
      const auto& g = got[item.key()].grad();
      ASSERT_EQ(g.defined(), item.value().grad().defined()) << "stage " << s << " " << item.key();
      if (!g.defined()) continue;
      EXPECT_LE((g - item.value().grad()).abs().max().item<double>(), 1e-12) << "stage " << s << " " << item.key();
    }
  }
  // Losses reach every rank through the transport's all-reduce (what the example does for its progress line).
  double sum = 0.0;
  for (double l : result.losses) sum += l;
  at::Tensor total = at::full({1}, sum, at::kDouble);
  pipeline.transport().all_reduce_sum(total, std::chrono::seconds(30));
  double expected = 0.0;
  for (double l : ref.losses) expected += l;
  EXPECT_NEAR(total.item<double>(), expected, 1e-9);
}

// A weight tied across stages (PipelineOptions::tied_parameters) between processes: the embedding of stage 0 and
// the head of the last, on two ranks (1F1B, interleaved 1F1B) or on rank 0 (ZB-V), with ranks between that hold no
// copy at 4 processes; each rank checks its part against the tied reference after clipped AdamW steps.
TEST(MpiTiedParameters, CopiesOnTwoRanksTrainAsTheTiedWeight) {
  using namespace tied;  // NOLINT(google-build-using-namespace)
  Float64Default float64;
  auto& env = *mpitest::g_mpi;
  const int p = env.world_size(), me = env.rank(), m = 2;
  for (const auto& [name, v] : std::vector<std::pair<std::string, int>>{{"1f1b", 1}, {"interleaved-1f1b", 2},
                                                                       {"zb-v", 2}}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      SCOPED_TRACE(name + " " + to_string(mode));
      const Schedule schedule = make_schedule(name, ScheduleOptions{p, m, v, mode});
      const int stages = schedule.num_stages;
      const Outcome ref = reference(stages, m);
      std::vector<int> my_stages = schedule.stages_of(me);
      std::vector<TiedChunk> mine;
      std::vector<PipelineChunk> chunks;
      for (int s : my_stages) {
        mine.emplace_back(s, stages);
        TiedChunk c = mine.back();
        chunks.push_back({s, c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }});
      }
      Pipeline pipeline(schedule, std::move(chunks), std::make_shared<MpiTransport>(env),
                        tied_options(stages, kSequences / m));
      torch::optim::AdamW adam(pipeline.parameters(), torch::optim::AdamWOptions(kLr));
      const Batch b = batch();
      const bool first = schedule.stage_to_rank[0] == me, last = schedule.stage_to_rank[stages - 1] == me;
      Outcome out;
      for (int step = 0; step < kSteps; ++step) {
        pipeline.zero_grad();
        const double loss = pipeline.mean_loss(pipeline.step(first ? NamedTensors(b.ids) : NamedTensors(),
                                                             last ? NamedTensors(b.targets) : NamedTensors()));
        ASSERT_TRUE(pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop, kMaxNorm));
        if (step == 0) {
          out.loss = loss;
          out.norm = pipeline.last_gradient_check().norm;
          record(out.grads, my_stages, mine, /*grads=*/true);
        }
        adam.step();
      }
      record(out.weights, my_stages, mine, /*grads=*/false);
      expect_same(out, ref, stages, /*whole=*/false);
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int f : {1, 2}) out.push_back({name, mode, f});
      out.push_back({name, mode, 1, /*frozen_first=*/true});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, MpiPipelineParity, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard") + "_m" +
                  std::to_string(info.param.m_factor) + "p" + (info.param.frozen_first ? "_frozen_first" : "");
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

}  // namespace
}  // namespace twobp::testing
