// StepMeter (twobp/plan/step_meter.h) on rank threads: what it records of each step, what its summary agrees over
// the ranks, and what it leaves out (warm-up steps, memory not recorded, no energy meter, one replica).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "common/temp_files.h"
#include "twobp/error.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/memory.h"
#include "twobp/plan/step_meter.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp {
namespace {

using testing::kDim;
using testing::kMicroBatchSize;

constexpr int kMicroBatches = 6;  // divisible by every p used (interleaved-1f1b)

// Runs `body(transport)` on `ranks` Local rank threads; returns the errors.
RankErrors on_threads(int ranks, const RankBody& body) {
  auto transports = make_local_transports(ranks);
  return run_rank_threads(transports, body);
}

// The fixture's model, one module per stage, built before the rank threads start (make_chunk seeds LibTorch's
// default generator, which rank threads share).
using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
Modules make_modules(int stages) {
  Modules out;
  for (int s = 0; s < stages; ++s) out.push_back(testing::make_chunk(s));
  return out;
}

// This pipeline rank's chunks of `modules`.
std::unique_ptr<Pipeline> make_pipeline(const Schedule& sc, const Modules& modules, Transport& pipeline_ranks,
                                        bool record_memory, Transport* replicas = nullptr) {
  std::vector<PipelineChunk> chunks;
  for (int s : sc.stages_of(pipeline_ranks.rank())) {
    auto m = modules[s];
    chunks.push_back({s, m, [m, s](const at::Tensor& x) { return testing::run_chunk(*m, s, x); }});
  }
  PipelineOptions o = testing::fixture_options();
  o.executor.record_memory = record_memory;
  o.data_parallel.group = replicas;
  return std::make_unique<Pipeline>(sc, std::move(chunks), pipeline_ranks, o);
}

at::Tensor batch(uint64_t seed) {
  at::manual_seed(seed);
  return at::randn({kMicroBatches * kMicroBatchSize, kDim}, at::kDouble);
}

class StepMeterTest : public ::testing::Test {
 protected:
  void SetUp() override { memory::count_cpu_allocations(); }  // before any model: record_memory on CPU needs it
  testing::Float64Default float64_;
};

// Every schedule form the summary reads differently: one chunk or two per rank, standard or 2BP, p = 2 or 3.
TEST_F(StepMeterTest, SummarizesTheRecordedStepsAlikeOnEveryRank) {
  for (const std::string name : {"1f1b", "interleaved-1f1b"}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : {2, 3}) {
        const Schedule sc = make_schedule(name, default_schedule_options(name, p, kMicroBatches, mode));
        SCOPED_TRACE(sc.name + " " + to_string(mode) + " p=" + std::to_string(p));
        std::mutex mutex;
        std::map<int, MeteredSteps> got;
        std::map<int, std::vector<double>> own_ms;
        const Modules modules = make_modules(sc.num_stages);
        const at::Tensor x = batch(1), y = batch(2);
        const RankErrors errors = on_threads(p, [&](Transport& t) {
          ParallelGroups groups(t, 1, std::chrono::seconds(60));
          auto pipeline = make_pipeline(sc, modules, groups.pipeline(), /*record_memory=*/true);
          StepMeter meter(*pipeline, t, {std::chrono::seconds(60)});
          for (int k = 0; k < 4; ++k) meter.step(x, y, /*record=*/k >= 1);  // one warm-up step
          MeteredSteps s = meter.summarize(groups);
          std::lock_guard<std::mutex> lock(mutex);
          got[t.rank()] = std::move(s);
          own_ms[t.rank()] = meter.step_ms();
        });
        ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
        for (int r = 0; r < p; ++r) {
          const MeteredSteps& s = got.at(r);
          EXPECT_EQ(s.steps, 3);
          EXPECT_EQ(s.step_ms, own_ms.at(0)) << "rank " << r << ": pipeline rank 0's step times";
          ASSERT_EQ(s.bubble.size(), 3u);
          for (std::size_t k = 0; k < 3; ++k) {
            EXPECT_GT(s.step_ms[k], 0.0);
            EXPECT_GE(s.bubble[k], 0.0);
            EXPECT_LT(s.bubble[k], 1.0);
          }
          for (int st = 0; st < sc.num_stages; ++st) {
            EXPECT_GT(s.costs.forward[st], 0.0) << "stage " << st;
            const bool split = mode == BackwardMode::kSplit;
            EXPECT_EQ(s.costs.backward_input[st] > 0.0, split) << "stage " << st;
            EXPECT_EQ(s.costs.backward_weight[st] > 0.0, split) << "stage " << st;
            EXPECT_EQ(s.costs.backward[st] > 0.0, !split) << "stage " << st;
          }
          EXPECT_EQ(s.costs.forward, got.at(0).costs.forward) << "rank " << r << " agrees with rank 0";
          EXPECT_EQ(s.costs.communication, 0.0);
          ASSERT_TRUE(s.memory.has_value());
          ASSERT_EQ(s.memory->measured.size(), static_cast<std::size_t>(p));
          ASSERT_EQ(s.attribution.size(), static_cast<std::size_t>(p));
          ASSERT_EQ(s.last_traces.size(), static_cast<std::size_t>(p));
          for (int q = 0; q < p; ++q) {
            EXPECT_GT(s.memory->measured[q], 0.0) << "rank " << q;
            EXPECT_EQ(s.attribution[q].rank, q);
            ASSERT_FALSE(s.last_traces[q].events.empty()) << "rank " << q;
            for (const TraceEvent& e : s.last_traces[q].events) EXPECT_EQ(e.rank, q);
          }
          EXPECT_FALSE(s.energy_j.has_value()) << "no meter given";
          EXPECT_TRUE(s.exposed_reduce_ms.empty()) << "one replica";
        }
      }
    }
  }
}

// step() zeroes the gradients before each step: after a warm-up and a recorded step they are one step's, as
// loss.backward() over the batch gives them (float64, every parameter).
TEST_F(StepMeterTest, EachStepStartsFromZeroGradients) {
  const Schedule sc = make_schedule("1f1b", default_schedule_options("1f1b", 2, kMicroBatches, BackwardMode::kSplit));
  const at::Tensor x = batch(3), y = batch(4);
  const testing::Reference ref = testing::run_reference(2, kMicroBatches, x, y);
  const Modules modules = make_modules(2);
  const RankErrors errors = on_threads(2, [&](Transport& t) {
    auto pipeline = make_pipeline(sc, modules, t, /*record_memory=*/false);
    StepMeter meter(*pipeline, t, {std::chrono::seconds(60)});
    meter.step(x, y, /*record=*/false);
    meter.step(x, y);
    const int s = sc.stages_of(t.rank()).front();
    const auto want = ref.chunks[s]->parameters(), have = modules[s]->parameters();
    ASSERT_EQ(want.size(), have.size());
    for (std::size_t k = 0; k < want.size(); ++k) {
      ASSERT_TRUE(have[k].grad().defined());
      EXPECT_TRUE(at::allclose(have[k].grad(), want[k].grad(), 1e-12, 1e-12)) << "stage " << s << " parameter " << k;
    }
    EXPECT_EQ(meter.steps(), 1);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
}

// add(): a step the caller timed is summarized with the caller's time; the bubble is 1 - Σ busy / (p x step).
// Without record_memory there is no memory summary.
TEST_F(StepMeterTest, StepsTimedByTheCallerKeepTheirTimes) {
  const Schedule sc = make_schedule("gpipe", default_schedule_options("gpipe", 2, kMicroBatches, BackwardMode::kSplit));
  std::mutex mutex;
  std::map<int, MeteredSteps> got;
  const Modules modules = make_modules(2);
  const at::Tensor x = batch(5), y = batch(6);
  const RankErrors errors = on_threads(2, [&](Transport& t) {
    ParallelGroups groups(t, 1, std::chrono::seconds(60));
    auto pipeline = make_pipeline(sc, modules, t, /*record_memory=*/false);
    StepMeter meter(*pipeline, t, {std::chrono::seconds(60)});
    for (double ms : {40.0, 10.0, 30.0}) {
      pipeline->zero_grad();
      StepResult result = pipeline->step(x, y);
      StepTimes times;
      times.pipeline_us = result.pipeline_us;
      times.step_us = (ms + t.rank()) * 1000.0;  // rank 1's differ: rank 0's are reported
      meter.add(std::move(result), times);
    }
    MeteredSteps s = meter.summarize(groups);
    std::lock_guard<std::mutex> lock(mutex);
    got[t.rank()] = std::move(s);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  for (int r = 0; r < 2; ++r) {
    const MeteredSteps& s = got.at(r);
    EXPECT_EQ(s.step_ms, (std::vector<double>{40.0, 10.0, 30.0}));
    EXPECT_FALSE(s.memory.has_value());
    double busy_ms = 0.0;
    for (const Trace& trace : s.last_traces) busy_ms += trace.busy_us() / 1000.0;
    EXPECT_NEAR(s.bubble.back(), 1.0 - busy_ms / (2 * 30.0), 1e-12) << "the last step's bubble from its traces";
  }
}

TEST_F(StepMeterTest, NoRecordedStepIsRefused) {
  const Schedule sc = make_schedule("1f1b", default_schedule_options("1f1b", 2, kMicroBatches, BackwardMode::kSplit));
  const Modules modules = make_modules(2);
  const at::Tensor x = batch(7), y = batch(8);
  const RankErrors errors = on_threads(2, [&](Transport& t) {
    ParallelGroups groups(t, 1, std::chrono::seconds(60));
    auto pipeline = make_pipeline(sc, modules, t, /*record_memory=*/false);
    StepMeter meter(*pipeline, t, {std::chrono::seconds(60)});
    meter.step(x, y, /*record=*/false);
    meter.summarize(groups);
  });
  for (const std::exception_ptr& e : errors.errors) {
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const UsageError& u) {
      EXPECT_NE(std::string(u.what()).find("no step was recorded"), std::string::npos) << u.what();
    }
  }
}

// Pipeline::switch_schedule keeps the placement the meter records by: steps of 1F1B 2BP, then GPipe standard, give
// both modes' costs on every stage.
TEST_F(StepMeterTest, StepsAcrossAScheduleSwitchAreRecordedAlike) {
  const Schedule sc = make_schedule("1f1b", default_schedule_options("1f1b", 2, kMicroBatches, BackwardMode::kSplit));
  const Schedule next =
      make_schedule("gpipe", default_schedule_options("gpipe", 2, kMicroBatches, BackwardMode::kStandard));
  const Modules modules = make_modules(2);
  const at::Tensor x = batch(14), y = batch(15);
  std::mutex mutex;
  std::map<int, MeteredSteps> got;
  const RankErrors errors = on_threads(2, [&](Transport& t) {
    ParallelGroups groups(t, 1, std::chrono::seconds(60));
    auto pipeline = make_pipeline(sc, modules, t, /*record_memory=*/false);
    StepMeter meter(*pipeline, t, {std::chrono::seconds(60)});
    meter.step(x, y);
    pipeline->switch_schedule(next);
    meter.step(x, y);
    MeteredSteps s = meter.summarize(groups);
    std::lock_guard<std::mutex> lock(mutex);
    got[t.rank()] = std::move(s);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got.at(r).steps, 2);
    for (int st = 0; st < 2; ++st) {
      EXPECT_GT(got.at(r).costs.backward_input[st], 0.0) << "stage " << st;
      EXPECT_GT(got.at(r).costs.backward[st], 0.0) << "stage " << st;
    }
  }
}

// Energy: every world rank's share summed, per recorded step. A powercap tree whose one package zone rank 0's
// first action of each step advances by 3 J: 3 J per step, the warm-up's not counted; a tree without zones: none.
TEST_F(StepMeterTest, EnergyIsTheJobsPerRecordedStep) {
  const std::string root = testing::make_temp_dir("step_meter_powercap");
  const std::string zone = root + "/intel-rapl:0";
  ::mkdir(zone.c_str(), 0755);
  std::ofstream(zone + "/name") << "package-0\n";
  std::ofstream(zone + "/max_energy_range_uj") << "1000000000000\n";
  std::ofstream(zone + "/energy_uj") << "0\n";
  const Schedule sc = make_schedule("1f1b", default_schedule_options("1f1b", 2, kMicroBatches, BackwardMode::kSplit));
  for (const bool metered : {true, false}) {
    std::mutex mutex;
    std::vector<std::optional<double>> got(2);
    const Modules modules = make_modules(2);
    const at::Tensor x = batch(9), y = batch(10);
    const RankErrors errors = on_threads(2, [&](Transport& t) {
      ParallelGroups groups(t, 1, std::chrono::seconds(60));
      auto pipeline = make_pipeline(sc, modules, t, /*record_memory=*/false);
      uint64_t uj = 0;
      int last_step = -1, step = 0;
      pipeline->add_hook([&](const ActionEvent&) {
        if (t.rank() != 0 || last_step == step) return;
        last_step = step;
        uj += 3000000;
        std::ofstream(zone + "/energy_uj") << uj << "\n";
      });
      energy::EnergyOptions o;
      o.powercap_root = metered ? root : root + "/nowhere";
      energy::RankEnergy rank_energy = energy::rank_energy(t, c10::Device(c10::DeviceType::CPU), o);
      StepMeter meter(*pipeline, t, {std::chrono::seconds(60), &rank_energy});
      for (step = 0; step < 3; ++step) meter.step(x, y, /*record=*/step >= 1);
      MeteredSteps s = meter.summarize(groups);
      std::lock_guard<std::mutex> lock(mutex);
      got[t.rank()] = s.energy_j;
    });
    ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
    for (int r = 0; r < 2; ++r) {
      if (metered) {
        ASSERT_TRUE(got[r].has_value()) << "rank " << r;
        EXPECT_NEAR(*got[r], 3.0, 1e-9) << "rank " << r;
      } else {
        EXPECT_FALSE(got[r].has_value()) << "rank " << r << ": rank 0 has no meter";
      }
    }
  }
  testing::remove_tree(root);
}

// Two replicas of a 2-rank pipeline: the exposed reduction wait per recorded step, the same on every world rank.
TEST_F(StepMeterTest, DataParallelStepsReportTheExposedReductionWait) {
  const Schedule sc = make_schedule("1f1b", default_schedule_options("1f1b", 2, kMicroBatches, BackwardMode::kSplit));
  std::mutex mutex;
  std::map<int, MeteredSteps> got;
  const std::vector<Modules> replicas{make_modules(2), make_modules(2)};
  const std::vector<at::Tensor> xs{batch(11), batch(12)};
  const at::Tensor y = batch(13);
  const RankErrors errors = on_threads(4, [&](Transport& world) {
    ParallelGroups groups(world, 2, std::chrono::seconds(60));
    auto pipeline = make_pipeline(sc, replicas[groups.replica()], groups.pipeline(), /*record_memory=*/false,
                                  groups.data_parallel());
    StepMeter meter(*pipeline, world, {std::chrono::seconds(60)});
    const at::Tensor& x = xs[groups.replica()];
    for (int k = 0; k < 3; ++k) meter.step(x, y, /*record=*/k >= 1);
    MeteredSteps s = meter.summarize(groups);
    std::lock_guard<std::mutex> lock(mutex);
    got[world.rank()] = std::move(s);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(got.at(r).exposed_reduce_ms.size(), 2u) << "rank " << r;
    EXPECT_EQ(got.at(r).exposed_reduce_ms, got.at(0).exposed_reduce_ms) << "rank " << r;
    for (double ms : got.at(r).exposed_reduce_ms) EXPECT_GE(ms, 0.0);
    EXPECT_EQ(got.at(r).attribution.size(), 2u) << "per pipeline rank";
  }
}

}  // namespace
}  // namespace twobp
