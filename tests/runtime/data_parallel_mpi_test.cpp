// Data x pipeline parity through real processes: under `mpiexec -n 2` (dp = 2 x pp = 1) and `-n 4` (dp = 2 x pp = 2),
// MPI transport, asynchronous gradient reductions; every built-in schedule x {standard, 2BP}, with and without
// overlap (standard mode also with its buckets started after the last B; dualpipev also with its overlapped pairs run
// at once), and with mixed precision (bfloat16 compute, the float32 masters' gradients averaged). Each rank checks
// its own chunks and losses against the single-process reference on the global batch (common/dp_cases.h), which every
// rank computes (it is small).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "common/dp_cases.h"
#include "common/mpi_test_env.h"
#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/mpi.h"

namespace twobp::testing {
namespace {

struct Case {
  std::string schedule;
  BackwardMode mode;
  bool overlap;
  bool start_during_backward = true;  // false: standard mode's buckets start after the stage's last B
  bool overlap_pairs = false;         // overlapped F&B pairs run at once (a thread each; common/overlap_hook.h)
};

void run_case(const Case& c, dp::Precision precision) {
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
  const dp::Reference ref = dp::reference(schedule.num_stages, batch, precision);
  dp::RankRun run;
  run.chunks = dp::chunks_of(schedule, env.rank() % pp, precision);
  MpiTransport world(env);
  dp::run_rank(world, dp, schedule, c.overlap, batch, run, precision, c.start_during_backward, c.overlap_pairs);
  dp::expect_matches(run, ref, "world rank " + std::to_string(env.rank()), precision);
}

class MpiDataPipelineParity : public ::testing::TestWithParam<Case> {
 protected:
  Float64Default float64_;
};

TEST_P(MpiDataPipelineParity, EveryReplicaHasTheGlobalBatchGradients) {
  run_case(GetParam(), dp::Precision::kDefault);
}

// Float32 default dtype: mixed precision builds its masters from float32 chunks.
class MpiMixedDataPipelineParity : public ::testing::TestWithParam<Case> {};

TEST_P(MpiMixedDataPipelineParity, MastersHaveTheGlobalBatchGradients) {
  run_case(GetParam(), dp::Precision::kMixedBf16);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (bool overlap : {true, false}) out.push_back({s, m, overlap});
      if (m == BackwardMode::kStandard) out.push_back({s, m, true, false});
      // Schedules with overlapped pairs (dualpipev): run at once, while the buckets reduce asynchronously.
      if (s == "dualpipev") out.push_back({s, m, true, true, true});
    }
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.schedule + "_" + (info.param.mode == BackwardMode::kSplit ? "2bp" : "standard") +
                  (info.param.overlap ? "" : "_no_overlap") + (info.param.start_during_backward ? "" : "_after_b") +
                  (info.param.overlap_pairs ? "_pairs_at_once" : "");
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
}

std::vector<Case> mixed_cases() {
  std::vector<Case> out;
  for (const auto& c : cases()) {
    if (c.overlap && c.start_during_backward && !c.overlap_pairs) out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, MpiDataPipelineParity, ::testing::ValuesIn(cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Schedules, MpiMixedDataPipelineParity, ::testing::ValuesIn(mixed_cases()), case_name);

}  // namespace
}  // namespace twobp::testing
