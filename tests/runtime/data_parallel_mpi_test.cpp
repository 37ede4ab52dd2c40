// Data x pipeline parity through real processes: under `mpiexec -n 2` (dp = 2 x pp = 1) and `-n 4` (dp = 2 x
// pp = 2), MPI transport, asynchronous gradient reductions; every built-in schedule x {standard, 2BP}, with and
// without overlap. Each rank checks its own chunks and losses against the single-process reference on the global
// batch (common/dp_cases.h), which every rank computes (it is small).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "common/dp_cases.h"
#include "common/mpi_test_env.h"
#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/transport/mpi.h"

namespace twobp::testing {
namespace {

struct Case {
  std::string schedule;
  BackwardMode mode;
  bool overlap;
};

class MpiDataPipelineParity : public ::testing::TestWithParam<Case> {
 protected:
  Float64Default float64_;
};

TEST_P(MpiDataPipelineParity, EveryReplicaHasTheGlobalBatchGradients) {
  const Case c = GetParam();
  auto& env = *mpitest::g_mpi;
  const int dp = 2, pp = env.world_size() / dp;
  ASSERT_EQ(env.world_size() % dp, 0) << "run under mpiexec -n 2 or -n 4";
  Schedule schedule;
  try {
    schedule = dp::replica_schedule(c.schedule, c.mode, pp);
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();  // same decision on every rank
  }
  const dp::GlobalBatch batch = dp::global_batch(dp);
  const dp::Reference ref = dp::reference(schedule.num_stages, batch);
  dp::RankRun run;
  run.chunks = dp::chunks_of(schedule, env.rank() % pp);
  MpiTransport world(env);
  dp::run_rank(world, dp, schedule, c.overlap, batch, run);
  dp::expect_matches(run, ref, "world rank " + std::to_string(env.rank()));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (bool overlap : {true, false}) out.push_back({s, m, overlap});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, MpiDataPipelineParity, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.schedule + "_" + (info.param.mode == BackwardMode::kSplit ? "2bp" : "standard") +
                  (info.param.overlap ? "" : "_no_overlap");
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
});

}  // namespace
}  // namespace twobp::testing
