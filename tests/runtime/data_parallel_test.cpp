// Data x pipeline parallelism with ranks as threads (Local transport): the rank layout and groups, parity of
// dp x pp against one process on the global batch for every built-in schedule x mode (float64, see
// common/dp_cases.h), and what is refused.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <optional>
#include <future>
#include <thread>

#include "common/dp_cases.h"
#include "common/expect_error.h"
#include "common/switch_pairs.h"
#include "common/test_scale.h"
#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

TEST(ParallelLayout, AdjacentStagesPerReplica) {
  const ParallelLayout l = ParallelLayout::of(8, 2);
  EXPECT_EQ(l.pp, 4);
  EXPECT_EQ(l.replica(5), 1);
  EXPECT_EQ(l.pipeline_rank(5), 1);
  EXPECT_EQ(l.world_rank(1, 3), 7);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l.world_rank(l.replica(r), l.pipeline_rank(r)), r);
  EXPECT_THROW(ParallelLayout::of(6, 4), UsageError);
  EXPECT_THROW(ParallelLayout::of(4, 0), UsageError);
}

TEST(ParallelGroups, GroupRanksFollowTheLayout) {
  auto world = make_local_transports(6);
  const auto errors = run_rank_threads(world, [](Transport& t) {
    ParallelGroups g(t, 3, std::chrono::seconds(30));
    EXPECT_EQ(g.pipeline().world_size(), 2);
    EXPECT_EQ(g.pipeline().rank(), t.rank() % 2);
    ASSERT_NE(g.data_parallel(), nullptr);
    EXPECT_EQ(g.data_parallel()->world_size(), 3);
    EXPECT_EQ(g.data_parallel()->rank(), t.rank() / 2);
    // The data-parallel group sums exactly the ranks holding the same pipeline rank.
    at::Tensor x = at::full({1}, static_cast<double>(t.rank()), at::kDouble);
    g.data_parallel()->all_reduce_sum(x, std::chrono::seconds(30));
    const int p = t.rank() % 2;
    EXPECT_EQ(x.item<double>(), p + (2 + p) + (4 + p));
  });
  errors.rethrow_root_cause();
}

TEST(ParallelGroups, OneReplicaSplitsNothing) {
  auto world = make_local_transports(2);
  run_rank_threads(world, [](Transport& t) {
    ParallelGroups g(t, 1, std::chrono::seconds(30));
    EXPECT_EQ(&g.pipeline(), &t);
    EXPECT_EQ(g.data_parallel(), nullptr);
  }).rethrow_root_cause();
}

struct DpCase {
  std::string schedule;
  BackwardMode mode;
  int dp;
  int pp;
  bool overlap;
};

class DataPipelineParity : public ::testing::TestWithParam<DpCase> {
 protected:
  Float64Default float64_;
};

// One dp x pp job on threads against one process on the global batch (common/dp_cases.h).
void expect_parity(const DpCase& c, dp::Precision precision, const dp::BeforeStep& before_step = nullptr,
                   int frozen_stages = 0) {
  Schedule schedule;
  try {
    schedule = dp::replica_schedule(c.schedule, c.mode, c.pp);
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();
  }
  const dp::GlobalBatch batch = dp::global_batch(c.dp);
  if (frozen_stages >= schedule.num_stages) GTEST_SKIP() << "the last stage trains";
  const dp::Reference ref = dp::reference(schedule.num_stages, batch, precision, before_step, frozen_stages);
  // Chunks are built on this thread (torch::manual_seed is process-wide), then trained by one thread per rank.
  std::vector<dp::RankRun> runs(c.dp * c.pp);
  for (int r = 0; r < c.dp * c.pp; ++r) {
    runs[r].chunks = dp::chunks_of(schedule, r % c.pp, precision, frozen_stages);
  }
  auto world = make_local_transports(c.dp * c.pp);
  run_rank_threads(world, [&](Transport& t) {
    dp::run_rank(t, c.dp, schedule, c.overlap, batch, runs[t.rank()], precision, true, false, nullptr,
                 before_step, frozen_stages);
  }).rethrow_root_cause();
  for (int r = 0; r < c.dp * c.pp; ++r) {
    dp::expect_matches(runs[r], ref, "world rank " + std::to_string(r), precision);
  }
}

TEST_P(DataPipelineParity, EveryReplicaHasTheGlobalBatchGradients) { expect_parity(GetParam(), dp::Precision::kDefault); }

std::vector<DpCase> dp_cases() {
  std::vector<DpCase> out;
  // Reduced scale (the sanitizers): each schedule runs pp = 2 in one mode and pp = 1 in the other (alternating from
  // schedule to schedule), so that it still meets both layouts and both modes.
  const std::vector<std::string> names = builtin_schedule_names();
  for (std::size_t n = 0; n < names.size(); ++n) {
    int j = 0;
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      if (runs_at_this_scale(n + j)) out.push_back({names[n], m, 2, 2, true});
      if (runs_at_this_scale(n + j + 1)) out.push_back({names[n], m, 2, 1, true});
      ++j;
    }
  }
  // Overlap off starts every bucket after the last action: the same result, by another path.
  out.push_back({"1f1b", BackwardMode::kSplit, 2, 2, false});
  out.push_back({"zb-v", BackwardMode::kSplit, 2, 2, false});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, DataPipelineParity, ::testing::ValuesIn(dp_cases()), [](const auto& info) {
  const DpCase& c = info.param;
  std::string n = c.schedule + "_" + (c.mode == BackwardMode::kSplit ? "2bp" : "standard") + "_dp" +
                  std::to_string(c.dp) + "_pp" + std::to_string(c.pp) + (c.overlap ? "" : "_no_overlap");
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
});

// Mixed precision x data parallelism: the replicas average the float32 masters' gradients; every built-in schedule
// x mode against one process's bfloat16 computation on the global batch (float32 default dtype: the chunks must be
// built in float32).
class MixedDataPipelineParity : public ::testing::TestWithParam<DpCase> {};

TEST_P(MixedDataPipelineParity, MastersHaveTheGlobalBatchGradients) {
  expect_parity(GetParam(), dp::Precision::kMixedBf16);
}

// Freezing parameters between steps needs nothing of the reducer or the masters (a frozen parameter's gradient
// stays as it was on every replica): before step 1 every other trainable tensor of every chunk stops training.
// (Unfreezing is refused: DataParallel.RefusesAParameterUnfrozenAfterConstruction.)
void freeze_every_other_before_step_1(int step, CaseModule& chunk) {
  if (step != 1) return;
  bool freeze = true;
  for (auto& p : unique_tensors(chunk.parameters())) {
    if (!p.requires_grad()) continue;
    if (freeze) p.set_requires_grad(false);
    freeze = !freeze;
  }
}

TEST_P(DataPipelineParity, ParametersFrozenBetweenSteps) {
  expect_parity(GetParam(), dp::Precision::kDefault, freeze_every_other_before_step_1);
}

TEST_P(MixedDataPipelineParity, ParametersFrozenBetweenSteps) {
  expect_parity(GetParam(), dp::Precision::kMixedBf16, freeze_every_other_before_step_1);
}

// A leading stage entirely frozen from the start (a frozen encoder or embedding): no gradient flows into it, the
// reducer has nothing of it to average (and mixed precision no master), the stages after it train as usual.
TEST_P(DataPipelineParity, LeadingStageEntirelyFrozen) {
  expect_parity(GetParam(), dp::Precision::kDefault, nullptr, /*frozen_stages=*/1);
}

TEST_P(MixedDataPipelineParity, LeadingStageEntirelyFrozen) {
  expect_parity(GetParam(), dp::Precision::kMixedBf16, nullptr, /*frozen_stages=*/1);
}

std::vector<DpCase> mixed_dp_cases() {
  std::vector<DpCase> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) out.push_back({s, m, 2, 2, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, MixedDataPipelineParity, ::testing::ValuesIn(mixed_dp_cases()),
                         [](const auto& info) {
                           const DpCase& c = info.param;
                           std::string n = c.schedule + "_" + (c.mode == BackwardMode::kSplit ? "2bp" : "standard");
                           std::replace_if(n.begin(), n.end(),
                                           [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); },
                                           '_');
                           return n;
                         });

// Data parallelism and mixed precision across Pipeline::switch_schedule: every replica switches before the second
// step to the next form of the same placement (common/switch_pairs.h); the replicas rebuild their reduction buckets
// for the new lists and must still end with the global batch's gradients (float64) or its bfloat16 reference.
struct SwitchDpCase {
  ScheduleForm from, to;
  dp::Precision precision = dp::Precision::kDefault;
};

class SwitchedDataPipelineParity : public ::testing::TestWithParam<SwitchDpCase> {};

TEST_P(SwitchedDataPipelineParity, ReplicasAgreeAcrossTheSwitch) {
  const SwitchDpCase& c = GetParam();
  std::optional<Float64Default> float64;
  if (c.precision == dp::Precision::kDefault) float64.emplace();
  constexpr int kDp = 2, kPp = 2;
  const Schedule from = dp::replica_schedule(c.from.name, c.from.mode, kPp);
  const Schedule to = dp::replica_schedule(c.to.name, c.to.mode, kPp);
  const dp::GlobalBatch batch = dp::global_batch(kDp);
  const dp::Reference ref = dp::reference(from.num_stages, batch, c.precision);
  std::vector<dp::RankRun> runs(kDp * kPp);
  for (int r = 0; r < kDp * kPp; ++r) runs[r].chunks = dp::chunks_of(from, r % kPp, c.precision);
  auto world = make_local_transports(kDp * kPp);
  run_rank_threads(world, [&](Transport& t) {
    dp::run_rank(t, kDp, from, /*overlap=*/true, batch, runs[t.rank()], c.precision, true, false, &to);
  }).rethrow_root_cause();
  for (int r = 0; r < kDp * kPp; ++r) {
    dp::expect_matches(runs[r], ref, "world rank " + std::to_string(r), c.precision);
  }
}

std::vector<SwitchDpCase> switched_dp_cases() {
  std::vector<SwitchDpCase> out;
  for (const auto& [from, to] : switch_pairs(2, dp::kMicroBatches)) {
    out.push_back({from, to, dp::Precision::kDefault});
    out.push_back({from, to, dp::Precision::kMixedBf16});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(SamePlacement, SwitchedDataPipelineParity, ::testing::ValuesIn(switched_dp_cases()),
                         [](const auto& info) {
                           const SwitchDpCase& c = info.param;
                           std::string n = c.from.label() + "_to_" + c.to.label() +
                                           (c.precision == dp::Precision::kMixedBf16 ? "_bf16" : "");
                           std::replace_if(n.begin(), n.end(),
                                           [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); },
                                           '_');
                           return n;
                         });

// A dp=2 x pp=2 job of one 1F1B step on 4 threads: `make(replica, stage)` builds the chunks, `targets_of` may
// change a replica's targets, `after` runs on every rank after the step. Returns every rank's error.
struct Job {
  std::function<std::shared_ptr<CaseModule>(int replica, int stage)> make = [](int, int s) {
    return dp::make_chunk(s);
  };
  BackwardMode mode = BackwardMode::kSplit;
  LossFunction loss = mse;
  std::function<at::Tensor(const at::Tensor&, int replica)> targets_of;
  std::function<void(Pipeline&, const StepResult&, int world_rank)> after;
};

RankErrors run_job(const Job& job) {
  const Schedule schedule = dp::replica_schedule("1f1b", job.mode, 2);
  std::vector<std::map<int, std::shared_ptr<CaseModule>>> chunks(4);
  for (int r = 0; r < 4; ++r) {
    for (int s : schedule.stages_of(r % 2)) chunks[r][s] = job.make(r / 2, s);
  }
  const dp::GlobalBatch batch = dp::global_batch(2);
  auto world = make_local_transports(4);
  return run_rank_threads(world, [&](Transport& t) {
    ParallelGroups groups(t, 2, std::chrono::seconds(30));
    std::vector<PipelineChunk> pc;
    for (auto& [s, m] : chunks[t.rank()]) {
      auto* raw = m.get();
      pc.push_back({s, m, [raw](const at::Tensor& x) { return raw->forward(x); }});
    }
    PipelineOptions o;
    o.executor.timeout = std::chrono::seconds(30);
    o.loss = job.loss;
    o.executor.activation_spec = [](int) { return TensorSpec{{dp::kMbs, dp::kSeq, dp::kDim}, at::kDouble}; };
    o.data_parallel.group = groups.data_parallel();
    Pipeline pipeline(schedule, std::move(pc), groups.pipeline(), o);
    const auto mine = dp::replica_batch(batch, groups.replica());
    const at::Tensor targets = job.targets_of ? job.targets_of(mine.targets, groups.replica()) : mine.targets;
    const StepResult result = pipeline.step(mine.inputs, targets);
    if (job.after) job.after(pipeline, result, t.rank());
  });
}

// One rank of a dp 2 x pp 2 job fails after its step with a twobp error; the others are then in the gradient
// check's collectives, which its abort ends. Every rank must report the root cause's type (not TransportError),
// the others marked as raised on another rank, naming rank 3 -- for each error type.
TEST(DataParallel, EveryRankReportsTheRootCausesType) {
  Float64Default f;
  auto check = [](auto error, const char* type) {
    using E = decltype(error);
    Job job;
    job.after = [](Pipeline& pipeline, const StepResult&, int world_rank) {
      if (world_rank == 3) throw E("rank 3: injected failure");
      pipeline.ready_for_optimizer(0, NonFinitePolicy::kStop);
    };
    const RankErrors errors = run_job(job);
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(errors.errors[r]) << type << ": rank " << r << " returned";
      const std::string what = error_message(errors.errors[r]);
      bool same_type = false, consequence = false;
      try {
        std::rethrow_exception(errors.errors[r]);
      } catch (const E& e) {
        same_type = true;
        consequence = dynamic_cast<const RaisedOnAnotherRank*>(&e) != nullptr;
      } catch (...) {
      }
      EXPECT_TRUE(same_type) << type << ": rank " << r << ": " << what;
      EXPECT_EQ(consequence, r != 3) << type << ": rank " << r << ": " << what;
      EXPECT_NE(what.find("injected failure"), std::string::npos) << type << ": rank " << r << ": " << what;
    }
    expect_error<E>([&] { errors.rethrow_root_cause(); }, {"rank 3: injected failure"});
  };
  check(NumericalError(""), "NumericalError");
  check(UsageError(""), "UsageError");
  check(IOError(""), "IOError");
}

// A dp 2 x pp 2 job (ranks as threads, 1 s timeouts; two steps, each followed by the gradient check) that stalls
// on one world rank: it sleeps 3 s before calling its second step (`late`: its caller busy between steps) or its
// first gradient check (`late_check`), or its forward of micro-batch 1 sleeps 3 s in the first step (`stuck`).
// Its replica's pipeline then waits on it, the other replica in a collective. Returns every world rank's error
// ("" for none).
struct Stall {
  int late = -1, late_check = -1, stuck = -1;
  int late_optimizer = -1;    // returns before the sharded optimizer's step
  int skips_evaluation = -1;  // every other rank evaluates after the first step
};
using RankChunks = std::vector<std::map<int, std::shared_ptr<CaseModule>>>;  // by world rank

// Every world rank's chunks (LibTorch's default generator: built before any job runs).
RankChunks stalled_job_chunks(const Schedule& schedule) {
  RankChunks chunks(4);
  for (int r = 0; r < 4; ++r) {
    for (int s : schedule.stages_of(r % 2)) chunks[r][s] = dp::make_chunk(s);
  }
  return chunks;
}

std::vector<std::string> stalled_job(const Schedule& schedule, RankChunks chunks, const dp::GlobalBatch& batch,
                                     Stall stall) {
  auto world = make_local_transports(4);
  const RankErrors errors = run_rank_threads(world, [&](Transport& t) {
    ParallelGroups groups(t, 2, std::chrono::seconds(30));
    std::vector<PipelineChunk> pc;
    for (auto& [s, m] : chunks[t.rank()]) {
      auto* raw = m.get();
      auto calls = std::make_shared<int>(0);  // this chunk's forwards so far (its rank's thread only)
      const bool stuck = t.rank() == stall.stuck;
      pc.push_back({s, m, [raw, calls, stuck](const at::Tensor& x) {
                      if (stuck && (*calls)++ == 1) std::this_thread::sleep_for(std::chrono::seconds(3));
                      return raw->forward(x);
                    }});
    }
    PipelineOptions o;
    o.executor.timeout = std::chrono::seconds(1);
    o.loss = mse;
    o.executor.activation_spec = [](int) { return TensorSpec{{dp::kMbs, dp::kSeq, dp::kDim}, at::kDouble}; };
    o.data_parallel.group = groups.data_parallel();
    Pipeline pipeline(schedule, std::move(pc), groups.pipeline(), o);
    ShardedOptimizer optimizer(pipeline, [](std::vector<at::Tensor> owned) {
      return std::make_unique<torch::optim::SGD>(std::move(owned), torch::optim::SGDOptions(0.01));
    });
    const auto mine = dp::replica_batch(batch, groups.replica());
    for (int step = 0; step < 2; ++step) {
      if (t.rank() == stall.late && step == 1) {
        std::this_thread::sleep_for(std::chrono::seconds(3));
        return;
      }
      pipeline.zero_grad();
      pipeline.step(mine.inputs, mine.targets);
      if (t.rank() == stall.late_check) {
        std::this_thread::sleep_for(std::chrono::seconds(3));
        return;
      }
      pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop);
      if (t.rank() == stall.late_optimizer) {
        std::this_thread::sleep_for(std::chrono::seconds(3));
        return;
      }
      optimizer.step();
      if (stall.skips_evaluation < 0) continue;
      if (t.rank() == stall.skips_evaluation) {
        std::this_thread::sleep_for(std::chrono::seconds(3));
        return;
      }
      pipeline.evaluate(mine.inputs, mine.targets);
    }
  });
  std::vector<std::string> out;
  for (const auto& e : errors.errors) out.push_back(e ? error_message(e) : "");
  return out;
}

// The one hang report that the errors of `ranks` carry (the same text on each), over every rank of the job.
std::string report_of(const std::vector<std::string>& errors, const std::vector<int>& ranks) {
  std::string first;
  for (int r : ranks) {
    const auto at = errors[r].find("hang report (");
    EXPECT_NE(at, std::string::npos) << "rank " << r << ": " << errors[r];
    if (at == std::string::npos) return "";
    if (first.empty()) first = errors[r].substr(at);
    EXPECT_EQ(errors[r].substr(at), first) << "rank " << r;
  }
  EXPECT_NE(first.find(", 4 ranks): "), std::string::npos) << first;
  return first;
}

// Whatever wait times out first -- the reduction of the replica that finished, or the pipeline of the one that
// waits -- every rank reports the culprit by its world rank, following the waits across both groups.
TEST(DataParallel, AStallIsNamedByWorldRankInOneJobWideReport) {
  Float64Default f;  // held until every job has ended
  const Schedule schedule = dp::replica_schedule("1f1b", BackwardMode::kSplit, 2);
  const dp::GlobalBatch batch = dp::global_batch(2);
  std::vector<Stall> stalls(5);
  stalls[0].late = 3;        // world rank 3 (replica 1, pipeline rank 1) late for its second step
  stalls[1].stuck = 2;       // world rank 2 (replica 1, pipeline rank 0) stuck in a forward of its first step
  stalls[2].late_check = 3;  // world rank 3 late for the gradient check after its first step
  stalls[3].late_optimizer = 3;    // world rank 3 late for the sharded optimizer's step after its first step
  stalls[4].skips_evaluation = 3;  // world rank 3 never evaluates: its pipeline's mean loss waits for it
  // The five jobs wait out their timeouts at once (each on rank threads and transports of its own).
  std::vector<RankChunks> chunks;
  for (std::size_t k = 0; k < stalls.size(); ++k) chunks.push_back(stalled_job_chunks(schedule));
  std::vector<std::future<std::vector<std::string>>> jobs;
  for (std::size_t k = 0; k < stalls.size(); ++k) {
    jobs.push_back(
        std::async(std::launch::async, [&, k] { return stalled_job(schedule, chunks[k], batch, stalls[k]); }));
  }
  std::vector<std::vector<std::string>> errors;
  for (auto& j : jobs) errors.push_back(j.get());
  {
    SCOPED_TRACE("world rank 3 late for its second step");
    EXPECT_EQ(errors[0][3], "");
    const std::string report = report_of(errors[0], {0, 1, 2});
    const std::string verdict = report.substr(0, report.find('\n'));
    EXPECT_NE(verdict.find("rank 3 has not started run 1"), std::string::npos) << report;
    EXPECT_NE(report.find("rank 1: waiting"), std::string::npos) << report;
    EXPECT_NE(report.find("for the data-parallel gradient reduction with ranks 3 (run 1)"), std::string::npos)
        << report;
  }
  {
    SCOPED_TRACE("world rank 2 stuck in a forward of its first step");
    const std::string report = report_of(errors[1], {0, 1, 3});
    const std::string verdict = report.substr(0, report.find('\n'));
    EXPECT_NE(verdict.find("rank 2 is computing F stage 0 micro-batch 1"), std::string::npos) << report;
    EXPECT_NE(report.find("rank 3: waiting"), std::string::npos) << report;
    EXPECT_NE(report.find("from rank 2 (run 0)"), std::string::npos) << report;
  }
  {
    SCOPED_TRACE("world rank 3 late for the gradient check after its first step");
    EXPECT_EQ(errors[2][3], "");
    const std::string report = report_of(errors[2], {0, 1, 2});
    const std::string verdict = report.substr(0, report.find('\n'));
    EXPECT_NE(verdict.find("rank 3 finished its part of run 0"), std::string::npos) << report;
    EXPECT_NE(verdict.find("has not joined the gradient check over the"), std::string::npos) << report;
    EXPECT_NE(report.find("rank 2: waiting"), std::string::npos) << report;
  }
  {
    SCOPED_TRACE("world rank 3 late for the sharded optimizer's step");
    const std::string report = report_of(errors[3], {0, 1, 2});
    const std::string verdict = report.substr(0, report.find('\n'));
    // Reached through rank 1's broadcast ("has not joined") or rank 2's receive ("has not started run 1").
    EXPECT_EQ(verdict.find("rank 3 "), verdict.find(": ") + 2) << report;
    EXPECT_NE(report.find("rank 1: waiting"), std::string::npos) << report;
    EXPECT_NE(report.find("for the sharded optimizer's broadcasts with ranks 3 (run 0)"), std::string::npos) << report;
  }
  {
    SCOPED_TRACE("world rank 3 skips the evaluation after the first step");
    const std::string report = report_of(errors[4], {0, 1, 2});
    const std::string verdict = report.substr(0, report.find('\n'));
    EXPECT_EQ(verdict.find("rank 3 "), verdict.find(": ") + 2) << report;
    EXPECT_NE(report.find("rank 2: waiting"), std::string::npos) << report;
    EXPECT_NE(report.find("rank 0: waiting"), std::string::npos) << report;
    EXPECT_NE(report.find("the mean loss over the replicas with ranks 2 (run 1)"), std::string::npos) << report;
    EXPECT_NE(report.find("the mean loss over the pipeline with ranks 3 (run 1)"), std::string::npos) << report;
  }
}

TEST(DataParallel, RefusesReplicasWithDifferentParameters) {
  Float64Default f;
  Job job;
  job.make = [](int replica, int s) -> std::shared_ptr<CaseModule> {
    torch::manual_seed(s);
    if (replica == 1 && s == 1) return std::make_shared<Frozen>(dp::kDim);  // other parameters
    return std::make_shared<RegisteredTwice>(dp::kDim);
  };
  const RankErrors errors = run_job(job);
  expect_error<UsageError>([&] { errors.rethrow_root_cause(); }, {"replicas disagree"});
}

// Ranks as threads: one chunk object given to both replicas of a stage is one set of tensors that both would
// accumulate into and count in the norm -- refused before the first micro-batch, naming the parameter and stage.
TEST(DataParallel, RefusesAChunkSharedByTwoReplicas) {
  Float64Default f;
  Job job;
  std::shared_ptr<CaseModule> shared;
  job.make = [&](int, int s) -> std::shared_ptr<CaseModule> {
    torch::manual_seed(s);
    if (s != 1) return std::make_shared<RegisteredTwice>(dp::kDim);
    if (!shared) shared = std::make_shared<RegisteredTwice>(dp::kDim);
    return shared;
  };
  const RankErrors errors = run_job(job);
  expect_error<UsageError>([&] { errors.rethrow_root_cause(); },
                           {"of stage 1 is also a tensor of stage 1 on data-parallel replica", "threads"});
}

// The reducer's buckets hold the parameters that required grad when the Pipeline was built: one unfrozen after
// the first step would never be averaged (the replicas would drift apart). The second step is refused on the rank
// that owns it, before any micro-batch, naming it; its peers fail at once with that error.
TEST(DataParallel, RefusesAParameterUnfrozenAfterConstruction) {
  Float64Default f;
  Job job;
  job.make = [](int, int s) -> std::shared_ptr<CaseModule> {
    torch::manual_seed(s);
    if (s == 1) return std::make_shared<Frozen>(dp::kDim);
    return std::make_shared<RegisteredTwice>(dp::kDim);
  };
  const dp::GlobalBatch batch = dp::global_batch(2);
  job.after = [&](Pipeline& pipeline, const StepResult&, int world_rank) {
    if (pipeline.rank() == 1) {
      auto frozen = pipeline.stage(1).module().named_parameters()["fast_frozen.weight"];
      ASSERT_FALSE(frozen.requires_grad());
      frozen.set_requires_grad(true);
    }
    const auto mine = dp::replica_batch(batch, world_rank / 2);
    pipeline.step(mine.inputs, mine.targets);
  };
  const RankErrors errors = run_job(job);
  expect_error<UsageError>([&] { errors.rethrow_root_cause(); },
                           {"rank 1 stage 1: parameter 'fast_frozen.weight' requires grad", "data-parallel reducer",
                            "build a new Pipeline"});
}

// A job whose stage 1 is `stage1()` (the other stages RegisteredTwice) must fail, in both backward modes, with a
// UsageError containing every one of `words`.
void expect_refused_in_both_modes(const std::function<std::shared_ptr<CaseModule>()>& stage1,
                                  const std::vector<std::string>& words) {
  Float64Default f;
  for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
    Job job;
    job.mode = mode;
    job.make = [&](int, int s) -> std::shared_ptr<CaseModule> {
      torch::manual_seed(s);
      if (s == 1) return stage1();
      return std::make_shared<RegisteredTwice>(dp::kDim);
    };
    const RankErrors errors = run_job(job);
    expect_error<UsageError>([&] { errors.rethrow_root_cause(); }, words);
  }
}

TEST(DataParallel, RefusesSparseGradientsNamingTheStage) {
  // TorchZoo holds an Embedding with sparse gradients.
  expect_refused_in_both_modes([] { return std::make_shared<TorchZoo>(dp::kDim); }, {"stage 1", "sparse gradient"});
}

/// A buffer updated in forward (like BatchNorm's running statistics).
struct RunningMean : CaseModule {
  RunningMean() {
    fc = register_module("fc", twobp::nn::Linear(dp::kDim, dp::kDim));
    mean = register_buffer("running_mean", torch::zeros({dp::kDim}));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    {
      torch::NoGradGuard no_grad;
      mean.mul_(0.9).add_(x.mean(std::vector<int64_t>{0, 1}), 0.1);
    }
    return fc(x) + x;
  }
  twobp::nn::Linear fc{nullptr};
  torch::Tensor mean;
};

TEST(DataParallel, RefusesBuffersUpdatedDuringTheStep) {
  expect_refused_in_both_modes([] { return std::make_shared<RunningMean>(); },
                               {"stage 1", "running_mean", "eval()"});
}

TEST(DataParallel, MeanLossIsOverTheGlobalBatch) {
  Float64Default f;
  const dp::Reference ref = dp::reference(2, dp::global_batch(2));
  double expected = 0.0;
  for (double l : ref.losses[0]) expected += l / static_cast<double>(ref.losses[0].size());
  std::vector<double> means(4, 0.0);
  Job job;
  job.after = [&](Pipeline& p, const StepResult& result, int rank) { means[rank] = p.mean_loss(result); };
  run_job(job).rethrow_root_cause();
  for (int r = 0; r < 4; ++r) EXPECT_NEAR(means[r], expected, 1e-12) << "world rank " << r;
}

// A loss whose value is NaN on one replica while every gradient stays finite: only the replica's own flags can
// tell, so every replica must hear of them to skip the step alike.
TEST(DataParallel, OptimizerGateDecidesAlikeOnEveryReplica) {
  Float64Default f;
  std::vector<int> gate(4, -1);
  Job job;
  job.loss = [](const at::Tensor& out, const at::Tensor& target) {
    return mse(out, target.nan_to_num()) + target.sum().detach() * 0.0;  // NaN value, finite gradient
  };
  job.targets_of = [](const at::Tensor& targets, int replica) {
    at::Tensor t = targets.clone();
    if (replica == 1) t.index_put_({0, 0, 0}, std::nan(""));
    return t;
  };
  job.after = [&](Pipeline& p, const StepResult&, int rank) {
    gate[rank] = p.ready_for_optimizer(0, NonFinitePolicy::kSkipStep) ? 1 : 0;
  };
  run_job(job).rethrow_root_cause();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(gate[r], 0) << "world rank " << r;
}

}  // namespace
}  // namespace twobp::testing
