// Stage boundaries of several named tensors through real processes: run under `mpiexec -n P`, MPI transport.
// Every schedule x {standard, 2BP}, with announced shapes that change per micro-batch and per step (and a tensor
// whose gradient is undefined), and with fixed specs; each rank checks its own chunks against the single-process
// reference (which every rank computes; it is small). See tests/common/boundary_cases.h for the model.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/boundary_cases.h"
#include "common/mpi_test_env.h"
#include "twobp/error.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/mpi.h"

namespace twobp::testing {
namespace {

struct Case {
  std::string schedule;
  BackwardMode mode;
  bool fixed_specs;
};

class MpiBoundaryParity : public ::testing::TestWithParam<Case> {
 protected:
  Float64Default float64_;
};

TEST_P(MpiBoundaryParity, LossesAndGradientsMatchSingleProcess) {
  const Case c = GetParam();
  auto& env = *mpitest::g_mpi;
  const int p = env.world_size(), me = env.rank(), m = 2 * p;
  Schedule schedule;
  try {
    schedule = make_schedule(c.schedule, default_schedule_options(c.schedule, p, m, c.mode));
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();  // same decision on every rank
  }
  const bool aux = !c.fixed_specs;
  std::vector<BoundaryBatch> steps;
  int seed = 20;
  for (const auto& lengths : boundary_lengths(2, m, !c.fixed_specs)) steps.push_back(make_boundary_batch(lengths, seed++));
  BoundaryReference ref = run_boundary_reference(schedule.num_stages, aux, steps);

  std::map<int, BoundaryChunk> mine;
  PipelineOptions options;
  options.executor.timeout = std::chrono::seconds(60);
  options.loss = boundary_loss;
  if (c.fixed_specs) options.executor.boundary_spec = [aux](int) { return boundary_spec(aux); };
  Pipeline pipeline(schedule, boundary_chunks(schedule, me, aux, &mine), std::make_shared<MpiTransport>(env), options);
  const bool first = me == schedule.stage_to_rank.front(), last = me == schedule.stage_to_rank.back();
  for (std::size_t i = 0; i < steps.size(); ++i) {
    StepResult result = pipeline.step(first ? steps[i].inputs : std::vector<NamedTensors>{},
                                      last ? steps[i].targets : std::vector<NamedTensors>{});
    if (!last) continue;
    ASSERT_EQ(result.losses.size(), static_cast<std::size_t>(m));
    for (int k = 0; k < m; ++k) EXPECT_NEAR(result.losses[k], ref.losses[i][k], 1e-12) << "step " << i << " mb " << k;
  }
  for (auto& [s, module] : mine) EXPECT_EQ(compare_gradients(*module, *ref.chunks[s], s), "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (bool fixed : {false, true}) out.push_back({name, mode, fixed});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, MpiBoundaryParity, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard") +
                  (info.param.fixed_specs ? "_fixed_specs" : "_announced_variable");
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

}  // namespace
}  // namespace twobp::testing
