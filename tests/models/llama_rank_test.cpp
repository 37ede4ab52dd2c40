// One pipeline rank of a LLaMa model (twobp/models/llama_rank.h): two ranks compute the loss of one rank holding the
// whole model, plain and with packed documents, whichever boundaries (fixed shapes or announced ones) they use.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "twobp/models/llama_rank.h"
#include "twobp/runtime/launch.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int kMicroBatches = 2;

struct Outcome {
  double loss = 0;
  std::map<std::string, std::vector<int64_t>> named;  // every rank's tensors by checkpoint name: their shapes
};

// One step of `ranks` ranks (1f1b 2BP, one stage each) on the same batch; rank 0's mean loss.
Outcome one_step(int ranks, bool pack, bool fixed_shapes) {
  const models::LlamaConfig config = models::config_by_name("tiny");
  models::LlamaRankOptions o{config, models::make_partition(config, ranks, 16), 7, 2, 16};
  o.pack = pack;
  o.fixed_shapes = fixed_shapes;
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{ranks, kMicroBatches, 1, BackwardMode::kSplit});
  torch::manual_seed(3);
  const at::Tensor tokens = torch::randint(0, config.vocab_size, {kMicroBatches * 2, 17}, at::kLong);
  const at::Tensor ids = tokens.narrow(1, 0, 16), next = tokens.narrow(1, 1, 16);
  Outcome out;
  std::mutex mutex;
  auto transports = make_local_transports(ranks);
  PipelineOptions base;
  base.executor.timeout = std::chrono::seconds(60);
  run_rank_threads(transports, [&](Transport& t) {
    models::LlamaRank rank = models::build_llama_rank(schedule, t, o, base);
    const bool first = t.rank() == 0, last = t.rank() == ranks - 1;
    const models::LlamaRankBatch batch =
        models::llama_rank_batch(ids, next, 0, kMicroBatches * 2, 16, first, last, pack, /*separator=*/10);
    EXPECT_EQ(batch.inputs.size() > 0, first);
    EXPECT_EQ(batch.targets.size() > 0, last);
    const StepResult result = rank.pipeline->step(batch.inputs, batch.targets);
    const double loss = rank.pipeline->mean_loss(result);
    std::lock_guard<std::mutex> lock(mutex);
    if (first) out.loss = loss;
    for (const auto& [name, tensor] : rank.named) out.named[name] = tensor.sizes().vec();
  }).rethrow_root_cause();
  return out;
}

TEST(LlamaRank, TwoRanksComputeWhatOneRankHoldingTheModelDoes) {
  for (bool pack : {false, true}) {
    for (bool fixed : {true, false}) {
      SCOPED_TRACE(fmt::format("pack {} fixed shapes {}", pack, fixed));
      const Outcome one = one_step(1, pack, fixed), two = one_step(2, pack, fixed);
      EXPECT_GT(one.loss, 0.0);
      EXPECT_NEAR(two.loss, one.loss, 1e-5 * one.loss);
      EXPECT_EQ(two.named, one.named);  // the same tensors under the same global names
    }
  }
}

TEST(LlamaRankBatch, IsTheRowsAndTokensOfTheEndsTheRankHolds) {
  const at::Tensor ids = torch::arange(40, at::kLong).reshape({4, 10}), next = ids + 1;
  const models::LlamaRankBatch both = models::llama_rank_batch(ids, next, 2, 2, 6, true, true, false, 0);
  EXPECT_TRUE(torch::equal(both.inputs.single("inputs"), ids.slice(0, 2, 4).slice(1, 0, 6)));
  EXPECT_TRUE(torch::equal(both.targets.single("targets"), next.slice(0, 2, 4).slice(1, 0, 6)));
  const models::LlamaRankBatch middle = models::llama_rank_batch(ids, next, 0, 4, 10, false, false, false, 0);
  EXPECT_TRUE(middle.inputs.empty() && middle.targets.empty());
  // Packed: the tokens with positions and document ids (what packed_inputs gives), the targets masked.
  const models::LlamaRankBatch packed = models::llama_rank_batch(ids, next, 0, 4, 10, true, true, true, 5);
  EXPECT_EQ(packed.inputs.size(), models::packed_inputs(ids, 5).size());
  EXPECT_EQ(packed.targets.size(), models::packed_targets(ids, next, 5).size());
}

TEST(LlamaRank, RefusesAPartitionOfAnotherStageCount) {
  const models::LlamaConfig config = models::config_by_name("tiny");
  models::LlamaRankOptions o{config, models::make_partition(config, 3, 16), 7, 2, 16};
  auto transports = make_local_transports(1);
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{1, kMicroBatches, 1, BackwardMode::kSplit});
  expect_error<UsageError>([&] { models::build_llama_rank(schedule, *transports[0], o, PipelineOptions{}); },
                           {"partition of 3 chunks", "1 stages"});
}

}  // namespace
}  // namespace twobp::testing
