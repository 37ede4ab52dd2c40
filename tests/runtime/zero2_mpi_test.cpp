// ZeRO-2 through real processes: under `mpiexec -n 4` (dp 2 x pp 2), MPI transport (asynchronous reduce-scatters
// started as W finishes each bucket, asynchronous all-gathers); every built-in schedule x {standard, 2BP}: each
// rank's parameters and the losses after AdamW steps with clipping against one process on the global batch
// (float64, common/zero2_cases.h), which every rank computes (it is small); mixed precision against ZeRO 0 once.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "common/mpi_test_env.h"
#include "common/zero2_cases.h"
#include "twobp/error.h"
#include "twobp/transport/mpi.h"

namespace twobp::testing {
namespace {

struct MpiZeroCase {
  std::string schedule;
  BackwardMode mode;
};

zero2::RankRun run_mpi_rank(const zero2::Config& c, int dp) {
  auto& env = *mpitest::g_mpi;
  const int pp = env.world_size() / dp;
  zero2::RankRun run;
  run.chunks = zero2::chunks_of(zero2::schedule_of(c, pp), env.rank() % pp);
  MpiTransport world(env);
  zero2::run_rank(world, dp, c, zero2::global_batch(dp), run);
  return run;
}

class MpiZero2Parity : public ::testing::TestWithParam<MpiZeroCase> {};

TEST_P(MpiZero2Parity, MatchesOneProcessOnTheGlobalBatch) {
  auto& env = *mpitest::g_mpi;
  const int dp = 2;
  ASSERT_EQ(env.world_size() % dp, 0) << "run under mpiexec -n 2 or -n 4";
  Float64Default float64;
  zero2::Config c;
  c.schedule = GetParam().schedule;
  c.mode = GetParam().mode;
  Schedule schedule;
  try {
    schedule = zero2::schedule_of(c, env.world_size() / dp);
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();  // same decision on every rank
  }
  const zero2::Reference ref = zero2::reference(schedule.num_stages, zero2::global_batch(dp));
  const zero2::RankRun run = run_mpi_rank(c, dp);
  zero2::expect_matches(run, ref.params, ref.losses, 1e-10, "world rank " + std::to_string(env.rank()));
  EXPECT_TRUE(run.grads_released);
}

TEST(MpiZero2, MixedPrecisionMatchesZeroZero) {
  zero2::Config c;
  c.mixed = true;
  const zero2::RankRun sharded = run_mpi_rank(c, 2);
  c.zero = ZeroStage::k0;
  const zero2::RankRun plain = run_mpi_rank(c, 2);
  zero2::expect_matches(sharded, plain.params, plain.losses, 1e-5,
                        "world rank " + std::to_string(mpitest::g_mpi->rank()));
}

std::vector<MpiZeroCase> mpi_zero_cases() {
  std::vector<MpiZeroCase> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) out.push_back({s, m});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, MpiZero2Parity, ::testing::ValuesIn(mpi_zero_cases()), [](const auto& info) {
  std::string n = info.param.schedule + "_" + (info.param.mode == BackwardMode::kSplit ? "2bp" : "standard");
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
});

}  // namespace
}  // namespace twobp::testing
