// The Executor on its own: hooks see every action once, in order, with its stage; items flow through one mailbox
// whether the consumer is on the same rank or not; a schedule that consumes an item before it is produced fails
// naming the action (and forgets the step) instead of hanging or reading stale data.

#include <gtest/gtest.h>
#include <torch/torch.h>


#include "common/expect_error.h"
#include "common/pipeline_fixtures.h"
#include "twobp/runtime/executor.h"
#include "twobp/runtime/launch.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

struct Rank {
  std::vector<std::unique_ptr<Stage>> owned;
  std::map<int, Stage*> stages;
};

// Stages of `schedule` on `rank`, built from the shared test chunks.
Rank stages_of(const Schedule& schedule, int rank, std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  Rank r;
  for (int s : schedule.stages_of(rank)) {
    StageOptions o;
    o.stage_index = s;
    o.num_stages = schedule.num_stages;
    o.rank = rank;
    if (s == schedule.num_stages - 1) {
      o.loss = mse;
      o.loss_scale = 1.0 / schedule.num_micro_batches;
    }
    auto* raw = modules[s].get();
    r.owned.push_back(std::make_unique<Stage>(modules[s], [raw, s](const at::Tensor& x) { return run_chunk(*raw, s, x); },
                                              o));
    r.stages.emplace(s, r.owned.back().get());
  }
  return r;
}

ExecutorOptions executor_options() {
  ExecutorOptions o;
  o.timeout = std::chrono::seconds(30);
  o.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  return o;
}

TEST(Executor, HooksSeeEveryActionOnceInOrderWithItsStage) {
  Float64Default f;
  // zb-v on 2 ranks: local hand-offs (stages 1 -> 2 on rank 1) and messages both ways.
  const Schedule schedule = make_schedule("zb-v", default_schedule_options("zb-v", 2, 4, BackwardMode::kSplit));
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int s = 0; s < schedule.num_stages; ++s) modules.push_back(make_chunk(s));
  auto transports = make_local_transports(2);
  auto inputs = torch::randn({4 * kMicroBatchSize, kDim}), targets = torch::randn({4 * kMicroBatchSize, kDim});
  Reference ref = run_reference(schedule.num_stages, 4, inputs, targets);

  std::vector<std::vector<const Action*>> seen(2);
  std::vector<StepResult> results(2);
  std::vector<Rank> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(stages_of(schedule, r, modules));
  run_rank_threads(
      transports,
      [&](Transport& t) {
        const int r = t.rank();
        Executor executor(schedule, r, ranks[r].stages, t, executor_options());
        executor.add_hook([&, r](const ActionEvent& e) {
          EXPECT_EQ(e.rank, r);
          EXPECT_EQ(e.stage != nullptr, is_compute(e.action->type)) << describe(*e.action);
          if (e.stage != nullptr) EXPECT_EQ(e.stage->options().stage_index, e.action->stage);
          seen[r].push_back(e.action);
        });
        results[r] = executor.run(inputs, targets);
      },
      /*abort_on_error=*/false)
      .rethrow_root_cause();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(seen[r].size(), schedule.actions[r].size()) << "rank " << r;
    for (std::size_t i = 0; i < seen[r].size(); ++i) EXPECT_EQ(seen[r][i], &schedule.actions[r][i]);
    EXPECT_EQ(results[r].trace.events.size(), schedule.actions[r].size());
  }
  // zb-v's last stage is on rank 0.
  ASSERT_EQ(results[0].losses.size(), 4u);
  for (int mb = 0; mb < 4; ++mb) EXPECT_NEAR(results[0].losses[mb], ref.losses[mb], 1e-12);
  for (int s = 0; s < schedule.num_stages; ++s) {
    auto got = modules[s]->named_parameters();
    for (const auto& item : ref.chunks[s]->named_parameters()) {
      EXPECT_LE((got[item.key()].grad() - item.value().grad()).abs().max().item<double>(), 1e-12) << item.key();
    }
  }
}

TEST(Executor, ItemConsumedBeforeItIsProducedIsAScheduleErrorNamingTheAction) {
  Float64Default f;
  // One rank, two stages: F of stage 1 for micro-batch 1 comes before F of stage 0 produced its input.
  Schedule sc;
  sc.name = "broken";
  sc.num_ranks = 1;
  sc.num_stages = 2;
  sc.num_micro_batches = 2;
  sc.backward = BackwardMode::kStandard;
  sc.stage_to_rank = {0, 0};
  sc.actions = {{{ActionType::kForward, 0, {0}},
                 {ActionType::kForward, 1, {1}},
                 {ActionType::kForward, 1, {0}},
                 {ActionType::kForward, 0, {1}},
                 {ActionType::kBackward, 1, {0}},
                 {ActionType::kBackward, 0, {0}},
                 {ActionType::kBackward, 1, {1}},
                 {ActionType::kBackward, 0, {1}}}};
  std::vector<std::shared_ptr<torch::nn::Module>> modules{make_chunk(0), make_chunk(1)};
  Rank rank = stages_of(sc, 0, modules);
  auto transports = make_local_transports(1);
  Executor executor(sc, 0, rank.stages, *transports[0], executor_options());
  expect_error<ScheduleError>(
      [&] { executor.run(torch::randn({4, kDim}), torch::randn({4, kDim})); },
      {"rank 0", "F stage 1 micro-batch 1", "the activation of stage 0 micro-batch 1", "not available"});
  for (auto& [s, stage] : rank.stages) EXPECT_EQ(stage->live_micro_batches(), 0u) << "stage " << s;
}

// Rank threads that compute on one non-CPU device share its allocator statistics (per process): recording memory
// there would report, and reset the peak of, each other's bytes. Refused at construction, before any device is
// touched (so this runs without one); a device of its own per rank thread is accepted as far as this check goes.
TEST(Executor, MemoryRecordingOnADeviceSharedByRankThreadsIsRefused) {
  Float64Default f;
  const Schedule sc = make_schedule("1f1b", default_schedule_options("1f1b", 2, 2, BackwardMode::kStandard));
  ExecutorOptions options = executor_options();
  options.record_memory = true;
  LocalOptions shared;
  shared.devices = {c10::Device(c10::kCUDA, 0)};
  auto transports = make_local_transports(2, shared);
  expect_error<UsageError>([&] { Executor e(sc, 0, std::map<int, Stage*>{}, *transports[0], options); },
                           {"rank 0", "cuda:0", "2 rank threads", "one rank per process", "LocalOptions::devices"});
  options.record_memory = false;
  options.memory_limit_bytes = 1 << 20;
  expect_error<UsageError>([&] { Executor e(sc, 1, std::map<int, Stage*>{}, *transports[1], options); },
                           {"rank 1", "2 rank threads"});
  // The chunks compute on a device that is not the transport's: whether other rank threads share it is unknown.
  options.memory_device = c10::Device(c10::kCUDA, 1);
  auto on_cpu = make_local_transports(2);
  expect_error<UsageError>([&] { Executor e(sc, 0, std::map<int, Stage*>{}, *on_cpu[0], options); },
                           {"cuda:1", "several rank threads"});
  LocalOptions own;
  own.devices = {c10::Device(c10::kCUDA, 0), c10::Device(c10::kCUDA, 1)};
  auto separate = make_local_transports(2, own);
  EXPECT_EQ(separate[0]->ranks_sharing_device(), 1);
  EXPECT_EQ(transports[0]->ranks_sharing_device(), 2);
}

// A batch whose tensors disagree on their rows (dimension 0, along which it is split) would be split into pieces
// that broadcast against each other -- training on wrong data. Refused before any action, naming the tensors and
// their sizes: inputs, targets, inputs against targets (this rank holds the first and the last stage), in the
// whole-batch and in the per-micro-batch form.
TEST(Executor, BatchesWhoseTensorsDisagreeOnRowsAreRefused) {
  Float64Default f;
  // One rank holding both stages: it checks inputs, targets and the two against each other.
  const Schedule sc = make_schedule("interleaved-1f1b", {/*ranks=*/1, /*micro_batches=*/2, /*chunks_per_rank=*/2,
                                                         BackwardMode::kStandard});
  std::vector<std::shared_ptr<torch::nn::Module>> modules{make_chunk(0), make_chunk(1)};
  Rank rank = stages_of(sc, 0, modules);
  auto transports = make_local_transports(1);
  Executor executor(sc, 0, rank.stages, *transports[0], executor_options());
  const int64_t rows = 2 * kMicroBatchSize;
  auto x = [](int64_t n) { return torch::randn({n, kDim}); };
  expect_error<UsageError>(
      [&] { executor.run(NamedTensors{{"x", x(rows)}, {"mask", torch::ones({rows / 2})}}, x(rows)); },
      {"rank 0", "inputs", "disagree", "rows", "'x': " + std::to_string(rows), "'mask': " + std::to_string(rows / 2)});
  expect_error<UsageError>(
      [&] { executor.run(x(rows), NamedTensors{{"y", x(rows)}, {"weight", torch::ones({2 * rows})}}); },
      {"rank 0", "targets", "'y': " + std::to_string(rows), "'weight': " + std::to_string(2 * rows)});
  expect_error<UsageError>([&] { executor.run(x(rows), x(rows / 2)); },
                           {"rank 0", "inputs have " + std::to_string(rows) + " rows", "targets " + std::to_string(rows / 2)});
  const std::vector<NamedTensors> targets{NamedTensors(x(kMicroBatchSize)), NamedTensors(x(kMicroBatchSize))};
  expect_error<UsageError>(
      [&] {
        executor.run(std::vector<NamedTensors>{NamedTensors(x(kMicroBatchSize)),
                                               NamedTensors{{"x", x(kMicroBatchSize)}, {"mask", torch::ones({1})}}},
                     targets);
      },
      {"rank 0", "micro-batch 1", "inputs", "'mask': 1"});
  expect_error<UsageError>(
      [&] {
        executor.run(std::vector<NamedTensors>{NamedTensors(x(kMicroBatchSize)), NamedTensors(x(kMicroBatchSize))},
                     std::vector<NamedTensors>{NamedTensors(x(kMicroBatchSize + 1)), NamedTensors(x(kMicroBatchSize))});
      },
      {"rank 0 micro-batch 0", "inputs have " + std::to_string(kMicroBatchSize) + " rows",
       "targets " + std::to_string(kMicroBatchSize + 1)});
  for (auto& [s, stage] : rank.stages) EXPECT_EQ(stage->live_micro_batches(), 0u) << "stage " << s;
}

}  // namespace
}  // namespace twobp::testing
