// LossReduction::kMeanOverItems: the step optimises the mean over every item (unmasked target) of the global batch,
// however the batch is cut -- 1, 2 or 4 micro-batches, 1 or 2 data-parallel replicas, 2BP or standard -- equal in
// float64 to one process's loss.backward() of that mean: the loss, every parameter's .grad and evaluate(). The
// batch is padded unevenly (rows hold 4, 3, ..., 0 items), so a mean of micro-batch means would differ (checked).
// Part of pipeline_test.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int64_t kRows = 8;  // the global batch

struct ItemBatch {
  torch::Tensor x, y, mask;
};

ItemBatch item_batch() {
  torch::manual_seed(7);
  ItemBatch b{torch::randn({kRows, kDim}), torch::randn({kRows, kDim}), torch::zeros({kRows, kDim})};
  for (int64_t r = 0; r < kRows; ++r) b.mask[r].narrow(0, 0, (kRows - 1 - r) * kDim / (kRows - 1)).fill_(1.0);
  return b;
}

// A micro-batch's loss: the SUM of its items' squared errors (padding masked out).
torch::Tensor summed_loss(const NamedTensors& out, const NamedTensors& t) {
  return (t["mask"] * (out.single("the loss") - t["y"]).pow(2)).sum();
}

struct Reference {
  double loss = 0.0, mean_of_means = 0.0;
  std::vector<torch::Tensor> grads;  // chunk 0's parameters, then chunk 1's
};

Reference reference(const ItemBatch& b, int micro_batches) {
  auto c0 = make_chunk(0), c1 = make_chunk(1);
  const torch::Tensor out = run_chunk(*c1, 1, run_chunk(*c0, 0, b.x));
  const torch::Tensor loss = (b.mask * (out - b.y).pow(2)).sum() / b.mask.sum();
  loss.backward();
  Reference ref{loss.item<double>(), 0.0, {}};
  for (const auto& c : {c0, c1}) {
    for (const auto& p : c->parameters()) ref.grads.push_back(p.grad().clone());
  }
  const auto rows = b.mask.split(kRows / micro_batches);
  const auto errors = ((out - b.y).pow(2) * b.mask).split(kRows / micro_batches);
  for (int k = 0; k < micro_batches; ++k) {
    ref.mean_of_means += (errors[k].sum() / rows[k].sum()).item<double>() / micro_batches;
  }
  return ref;
}

struct ItemRun {
  double loss = 0.0, evaluated = 0.0;
  std::vector<torch::Tensor> grads;  // by stage, as the reference
};

// dp replicas of a 2-rank pipeline (schedule `name`, `mode`) with `m` micro-batches per replica, over items.
ItemRun run_over_items(const ItemBatch& b, const std::string& name, BackwardMode mode, int m, int dp) {
  const Schedule schedule = make_schedule(name, ScheduleOptions{2, m, 1, mode});
  const int64_t share = kRows / dp, mbs = share / m;
  auto transports = make_local_transports(2 * dp);
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;
  for (int w = 0; w < 2 * dp; ++w) chunks.push_back(make_chunk(w % 2));  // built here: one generator, one thread
  ItemRun run;
  std::mutex mutex;
  const RankErrors errors = run_rank_threads(transports, [&](Transport& world) {
    ParallelGroups groups(world, dp, std::chrono::seconds(60));
    const int s = groups.pipeline_rank(), replica = groups.replica();
    PipelineOptions o;
    o.loss = summed_loss;
    o.loss_reduction = LossReduction::kMeanOverItems;
    o.loss_items = [](const NamedTensors& t) { return t["mask"].sum().item<double>(); };
    o.executor.timeout = std::chrono::seconds(60);
    o.executor.activation_spec = [mbs](int) { return TensorSpec{{mbs, kDim}, at::kDouble}; };
    o.data_parallel.group = groups.data_parallel();
    auto module = chunks[world.rank()];
    std::vector<PipelineChunk> mine{
        {s, module, [raw = module.get(), s](const at::Tensor& x) { return run_chunk(*raw, s, x); }}};
    Pipeline pipeline(schedule, std::move(mine), groups.pipeline(), o);
    const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, replica * share, share); };
    const NamedTensors inputs = s == 0 ? NamedTensors(rows(b.x)) : NamedTensors();
    const NamedTensors targets = s == 1 ? NamedTensors{{"y", rows(b.y)}, {"mask", rows(b.mask)}} : NamedTensors();
    const double loss = pipeline.mean_loss(pipeline.step(inputs, targets));
    const double evaluated = pipeline.evaluate(inputs, targets);
    std::lock_guard<std::mutex> lock(mutex);
    if (world.rank() == 0) {
      run.loss = loss;
      run.evaluated = evaluated;
    }
    if (replica == 0) {
      std::vector<torch::Tensor> mine;
      for (const auto& p : module->parameters()) mine.push_back(p.grad().clone());
      run.grads.insert(s == 0 ? run.grads.begin() : run.grads.end(), mine.begin(), mine.end());
    }
  });
  if (!errors.ok()) errors.rethrow_root_cause();
  return run;
}

TEST(LossOverItems, AnyCutOfTheBatchGivesTheGlobalTokenMeanAndItsGradients) {
  Float64Default float64;  // chunks, batch and reference in float64 (set before any rank thread starts)
  const ItemBatch b = item_batch();
  const Reference ref = reference(b, 2);  // 2 micro-batches of 11 and 2 items: their means' mean is not the mean
  EXPECT_GT(std::abs(ref.mean_of_means - ref.loss), 1e-3) << "the batch must tell the two reductions apart";
  for (const auto& [dp, m] : std::vector<std::pair<int, int>>{{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 2}}) {
    for (const BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
      for (const std::string name : {"1f1b", "gpipe"}) {
        SCOPED_TRACE(name + " " + to_string(mode) + " dp " + std::to_string(dp) + " m " + std::to_string(m));
        const ItemRun run = run_over_items(b, name, mode, m, dp);
        EXPECT_NEAR(run.loss, ref.loss, 1e-12 * std::abs(ref.loss));
        EXPECT_NEAR(run.evaluated, ref.loss, 1e-12 * std::abs(ref.loss));  // no gradient step in between
        ASSERT_EQ(run.grads.size(), ref.grads.size());
        for (std::size_t k = 0; k < ref.grads.size(); ++k) {
          EXPECT_TRUE(torch::allclose(run.grads[k], ref.grads[k], 1e-12, 1e-14)) << "parameter " << k;
        }
      }
    }
  }
}

TEST(LossOverItems, WithoutACountItIsRefused) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  auto module = make_chunk(1);
  PipelineOptions o = fixture_options();
  o.loss_reduction = LossReduction::kMeanOverItems;
  try {  // no loss_items
    Pipeline(schedule, {{1, module, [raw = module.get()](const at::Tensor& x) { return run_chunk(*raw, 1, x); }}},
             std::move(transports[1]), o);
    ADD_FAILURE() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("PipelineOptions::loss_items"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace twobp::testing
