// LossReduction::kMeanOverItems: the step optimises the mean over every item (unmasked target) of the global batch,
// however the batch is cut -- 1, 2 or 4 micro-batches, 1 or 2 data-parallel replicas, 2BP or standard, schedules of
// one and of two stages per rank -- equal in float64 to one process's loss.backward() of that mean: the loss, every
// parameter's .grad and evaluate(). Two kinds of batch where micro-batches hold different numbers of items:
//   padded  rows of unequal length (4, 3, 2, 2, 1, 1, 0, 0 items), the pad targets masked;
//   packed  rows holding several documents each, the loss mask of models::packed_targets (0 where the input is a
//           document's separator: its target is the next document's first token).
// kMeanOfMicroBatches on the same batches gives the mean of the micro-batch means instead: the global mean only for
// an uncut batch (checked both ways, so that the invariance above is a property of kMeanOverItems, not of the data).
// Part of pipeline_test.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/models/llama.h"
#include "twobp/models/llama_rank.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int64_t kRows = 8;  // the global batch: kRows rows of kDim targets each

struct ItemBatch {
  torch::Tensor x, y, mask;  // inputs, targets and loss mask [kRows, kDim]; x and y drawn from one seed
};

ItemBatch random_rows(torch::Tensor mask) {
  torch::manual_seed(7);
  return {torch::randn({kRows, kDim}), torch::randn({kRows, kDim}), std::move(mask)};
}

// Rows of unequal length, padded to kDim: row r holds (kRows - 1 - r) * kDim / (kRows - 1) items.
ItemBatch padded_batch() {
  torch::Tensor mask = torch::zeros({kRows, kDim});
  for (int64_t r = 0; r < kRows; ++r) mask[r].narrow(0, 0, (kRows - 1 - r) * kDim / (kRows - 1)).fill_(1.0);
  return random_rows(mask);
}

// Packed rows: token ids where kSeparator ends a document; the first four rows hold documents of one or two tokens,
// the others one or two long ones, so the micro-batches hold 8 and 15 items (2 micro-batches) or 4, 4, 8, 7 (4).
ItemBatch packed_batch() {
  constexpr int64_t S = 0;  // the separator
  const std::vector<int64_t> rows = {3, S, 4, S,  S, 5, S, 6,  7, S, S, 8,  S, 9, 2, S,
                                     1, 2, 3, 4,  5, 6, 7, 8,  9, 8, 7, 6,  2, S, 4, 5};
  const torch::Tensor ids = torch::tensor(rows, at::kLong).reshape({kRows, kDim});
  const NamedTensors targets = models::packed_targets(ids, ids.roll(-1, 1), S);
  return random_rows(targets[models::kLossMask].to(at::kDouble));
}

// The mean of `pieces` equal row slices' means (a slice without items counts 0, as masked_cross_entropy_loss's
// clamp does): what kMeanOfMicroBatches optimises for dp x m = pieces.
torch::Tensor mean_of_slice_means(const torch::Tensor& errors, const torch::Tensor& mask, int pieces) {
  torch::Tensor sum = torch::zeros({});
  const auto e = errors.split(kRows / pieces), k = mask.split(kRows / pieces);
  for (int p = 0; p < pieces; ++p) sum = sum + e[p].sum() / k[p].sum().clamp_min(1.0);
  return sum / pieces;
}

struct Reference {
  double loss = 0.0;
  std::vector<torch::Tensor> grads;  // chunk 0's parameters, then chunk 1's, ...
};

// One process, `stages` chunks in a row: loss.backward() of the token mean, or with `pieces` > 0 of the mean of the
// `pieces` slices' means.
Reference reference(const ItemBatch& b, int stages, int pieces = 0) {
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;
  torch::Tensor out = b.x;
  for (int s = 0; s < stages; ++s) {
    chunks.push_back(make_chunk(s));
    out = run_chunk(*chunks.back(), s, out);
  }
  const torch::Tensor errors = b.mask * (out - b.y).pow(2);
  const torch::Tensor loss = pieces > 0 ? mean_of_slice_means(errors, b.mask, pieces) : errors.sum() / b.mask.sum();
  loss.backward();
  Reference ref{loss.item<double>(), {}};
  for (const auto& c : chunks) {
    for (const auto& p : c->parameters()) ref.grads.push_back(p.grad().clone());
  }
  return ref;
}

// A micro-batch's loss over items: the SUM of its items' squared errors (padding, separators masked out).
torch::Tensor summed_loss(const NamedTensors& out, const NamedTensors& t) {
  return (t["mask"] * (out.single("the loss") - t["y"]).pow(2)).sum();
}
// ... and its MEAN, for kMeanOfMicroBatches (0 for a micro-batch without items).
torch::Tensor micro_batch_mean_loss(const NamedTensors& out, const NamedTensors& t) {
  return summed_loss(out, t) / t["mask"].sum().clamp_min(1.0);
}

struct Cut {
  int dp = 1, m = 1;  // replicas, micro-batches per replica
  std::string str() const { return "dp " + std::to_string(dp) + " m " + std::to_string(m); }
};
const std::vector<Cut> kCuts = {{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 2}};

struct ItemRun {
  double loss = 0.0, evaluated = 0.0;
  std::vector<torch::Tensor> grads;  // replica 0's, by stage, as the reference
};

// dp replicas of a 2-rank pipeline (schedule `name` with its default chunks per rank, `mode`), each with `m`
// micro-batches of its share of the batch, reducing the losses by `reduction`.
ItemRun run_cut(const ItemBatch& b, const std::string& name, BackwardMode mode, Cut cut, LossReduction reduction) {
  const Schedule schedule = make_schedule(name, default_schedule_options(name, 2, cut.m, mode));
  const int64_t share = kRows / cut.dp, mbs = share / cut.m;
  auto transports = make_local_transports(2 * cut.dp);
  // Every world rank's chunks, built here: one generator, one thread (make_chunk seeds by stage).
  std::vector<std::map<int, std::shared_ptr<torch::nn::Module>>> chunks(2 * cut.dp);
  for (int w = 0; w < 2 * cut.dp; ++w) {
    for (int s : schedule.stages_of(w % 2)) chunks[w][s] = make_chunk(s);
  }
  std::map<int, std::vector<torch::Tensor>> grads;  // replica 0's, by stage
  ItemRun run;
  std::mutex mutex;
  const RankErrors errors = run_rank_threads(transports, [&](Transport& world) {
    ParallelGroups groups(world, cut.dp, std::chrono::seconds(60));
    const int p = groups.pipeline_rank(), replica = groups.replica();
    PipelineOptions o;
    o.loss_reduction = reduction;
    o.loss = reduction == LossReduction::kMeanOverItems ? LossFunction(summed_loss)
                                                        : LossFunction(micro_batch_mean_loss);
    o.loss_items = [](const NamedTensors& t) { return t["mask"].sum().item<double>(); };
    o.executor.timeout = std::chrono::seconds(60);
    o.executor.activation_spec = [mbs](int) { return TensorSpec{{mbs, kDim}, at::kDouble}; };
    o.data_parallel.group = groups.data_parallel();
    std::vector<PipelineChunk> mine;
    for (const auto& [s, module] : chunks[world.rank()]) {
      mine.push_back({s, module, [raw = module.get(), s = s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
    }
    Pipeline pipeline(schedule, std::move(mine), groups.pipeline(), o);
    const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, replica * share, share); };
    const bool first = schedule.stage_to_rank.front() == p, last = schedule.stage_to_rank.back() == p;
    const NamedTensors inputs = first ? NamedTensors(rows(b.x)) : NamedTensors();
    const NamedTensors targets = last ? NamedTensors{{"y", rows(b.y)}, {"mask", rows(b.mask)}} : NamedTensors();
    const double loss = pipeline.mean_loss(pipeline.step(inputs, targets));
    const double evaluated = pipeline.evaluate(inputs, targets);
    std::lock_guard<std::mutex> lock(mutex);
    if (world.rank() == 0) {
      run.loss = loss;
      run.evaluated = evaluated;
    }
    if (replica == 0) {
      for (const auto& [s, module] : chunks[world.rank()]) {
        for (const auto& param : module->parameters()) grads[s].push_back(param.grad().clone());
      }
    }
  });
  if (!errors.ok()) errors.rethrow_root_cause();
  for (auto& [s, g] : grads) run.grads.insert(run.grads.end(), g.begin(), g.end());
  return run;
}

// The stages of schedule `name` on 2 ranks with its default chunks per rank.
int stage_count(const std::string& name) {
  return 2 * default_schedule_options(name, 2, 1, BackwardMode::kSplit).chunks_per_rank;
}

// Whether `run` is the reference's step, in float64: loss, evaluate() and every gradient.
void expect_reference(const ItemRun& run, const Reference& ref) {
  EXPECT_NEAR(run.loss, ref.loss, 1e-12 * std::abs(ref.loss));
  EXPECT_NEAR(run.evaluated, ref.loss, 1e-12 * std::abs(ref.loss));  // no gradient step in between
  ASSERT_EQ(run.grads.size(), ref.grads.size());
  for (std::size_t k = 0; k < ref.grads.size(); ++k) {
    EXPECT_TRUE(torch::allclose(run.grads[k], ref.grads[k], 1e-12, 1e-14)) << "parameter " << k;
  }
}

// Every cut of `b` under every schedule in both modes gives the reference's token mean and gradients.
void expect_invariant(const ItemBatch& b) {
  for (const std::string name : {"1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v"}) {
    const Reference ref = reference(b, stage_count(name));
    for (const BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
      for (const Cut& cut : kCuts) {
        SCOPED_TRACE(name + " " + to_string(mode) + " " + cut.str());
        expect_reference(run_cut(b, name, mode, cut, LossReduction::kMeanOverItems), ref);
      }
    }
  }
}

TEST(LossOverItems, PaddedRowsGiveTheGlobalTokenMeanAndItsGradientsUnderAnyCut) {
  Float64Default float64;  // chunks, batch and reference in float64 (set before any rank thread starts)
  expect_invariant(padded_batch());
}

TEST(LossOverItems, PackedDocumentsGiveTheGlobalTokenMeanAndItsGradientsUnderAnyCut) {
  Float64Default float64;
  const ItemBatch b = packed_batch();
  ASSERT_EQ(b.mask.sum().item<double>(), 23.0) << b.mask;  // 9 separators masked out of 32 targets
  expect_invariant(b);
}

// The control: over micro-batches, a cut batch optimises the mean of its pieces' means -- not the token mean, whose
// gradients differ measurably -- and only the uncut batch the token mean.
TEST(LossOverItems, TheMeanOfMicroBatchesDependsOnTheCut) {
  Float64Default float64;
  for (const ItemBatch& b : {padded_batch(), packed_batch()}) {
    const Reference token_mean = reference(b, 2);
    for (const BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
      for (const Cut& cut : kCuts) {
        SCOPED_TRACE(std::string(to_string(mode)) + " " + cut.str());
        const ItemRun run = run_cut(b, "1f1b", mode, cut, LossReduction::kMeanOfMicroBatches);
        const int pieces = cut.dp * cut.m;
        expect_reference(run, reference(b, 2, pieces));
        if (pieces == 1) {
          expect_reference(run, token_mean);
          continue;
        }
        EXPECT_GT(std::abs(run.loss - token_mean.loss), 1e-3 * std::abs(token_mean.loss));
        double largest = 0.0;  // the largest gradient difference, relative to the token mean's gradient
        for (std::size_t k = 0; k < run.grads.size(); ++k) {
          largest = std::max(largest, ((run.grads[k] - token_mean.grads[k]).abs().max() /
                                       token_mean.grads[k].abs().max()).item<double>());
        }
        EXPECT_GT(largest, 1e-3);
      }
    }
  }
}

// ---- models::build_llama_rank: packed documents over items by default ----

constexpr int64_t kLlamaSeq = 16, kSeparator = 10;

struct LlamaStep {
  double loss = 0.0;
  std::map<std::string, torch::Tensor> grads;  // by global parameter name
};

// A packed batch of kRows rows whose first half is dense with separators (documents of one or two tokens) and
// second half has none: micro-batches of different token counts. `ids` and `next`, [kRows, kLlamaSeq] each.
std::pair<torch::Tensor, torch::Tensor> packed_llama_batch(int64_t vocab) {
  torch::manual_seed(11);
  torch::Tensor tokens = torch::randint(kSeparator + 1, vocab, {kRows, kLlamaSeq + 1}, at::kLong);
  for (int64_t t = 1; t < kLlamaSeq; t += 2) tokens.narrow(0, 0, kRows / 2).select(1, t).fill_(kSeparator);
  return {tokens.narrow(1, 0, kLlamaSeq), tokens.narrow(1, 1, kLlamaSeq)};
}

// loss.backward() of the token mean over the whole batch on one LlamaChunk holding the whole model (float32: the
// model's loss computes in float32).
LlamaStep llama_reference(const models::LlamaConfig& config, const torch::Tensor& ids, const torch::Tensor& next) {
  models::LlamaChunk chunk(config, models::make_partition(config, 1, kLlamaSeq).chunks[0], /*seed=*/7);
  const torch::Tensor loss = models::masked_cross_entropy_loss(chunk->forward(models::packed_inputs(ids, kSeparator)),
                                                               models::packed_targets(ids, next, kSeparator));
  loss.backward();
  LlamaStep ref{loss.item<double>(), {}};
  for (const auto& p : chunk->named_parameters()) ref.grads[p.key()] = p.value().grad().clone();
  return ref;
}

// One step of 2 ranks (1f1b, 2BP) built by build_llama_rank with `pack`, the batch cut into `m` micro-batches.
LlamaStep llama_pipeline_step(const models::LlamaConfig& config, const torch::Tensor& ids, const torch::Tensor& next,
                              int m, LossReduction reduction) {
  models::LlamaRankOptions o{config, models::make_partition(config, 2, kLlamaSeq), 7, kRows / m, kLlamaSeq};
  o.pack = true;
  o.loss_reduction = reduction;
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, m, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  PipelineOptions base;
  base.executor.timeout = std::chrono::seconds(60);
  LlamaStep out;
  std::mutex mutex;
  run_rank_threads(transports, [&](Transport& t) {
    models::LlamaRank rank = models::build_llama_rank(schedule, t, o, base);
    const models::LlamaRankBatch batch =
        models::llama_rank_batch(ids, next, 0, kRows, kLlamaSeq, t.rank() == 0, t.rank() == 1, true, kSeparator);
    const double loss = rank.pipeline->mean_loss(rank.pipeline->step(batch.inputs, batch.targets));
    std::lock_guard<std::mutex> lock(mutex);
    if (t.rank() == 0) out.loss = loss;
    for (const auto& [name, tensor] : rank.named) {
      if (tensor.grad().defined()) out.grads[name] = tensor.grad().clone();
    }
  }).rethrow_root_cause();
  return out;
}

// The largest difference of two runs' gradients, relative to the largest entry of the reference's, over parameters.
double largest_gradient_difference(const LlamaStep& run, const LlamaStep& ref) {
  EXPECT_EQ(run.grads.size(), ref.grads.size());
  double largest = 0.0;
  for (const auto& [name, g] : ref.grads) {
    const auto it = run.grads.find(name);
    if (it == run.grads.end()) {
      ADD_FAILURE() << "no gradient for " << name;
      continue;
    }
    largest = std::max(largest, ((it->second - g).abs().max() / g.abs().max().clamp_min(1e-30)).item<double>());
  }
  return largest;
}

// LlamaRankOptions' default: packed documents cut into 1, 2 or 4 micro-batches give the token mean over the global
// batch and its gradients (float32, the model's loss); 0.2's mean of micro-batch means does not once the batch is cut.
TEST(LossOverItems, LlamaRankOptimisesThePackedTokenMeanByDefault) {
  const models::LlamaConfig config = models::config_by_name("tiny");
  const auto [ids, next] = packed_llama_batch(config.vocab_size);
  const LlamaStep ref = llama_reference(config, ids, next);
  EXPECT_EQ(models::LlamaRankOptions{}.loss_reduction, LossReduction::kMeanOverItems);
  for (const int m : {1, 2, 4}) {
    SCOPED_TRACE("m " + std::to_string(m));
    const LlamaStep run = llama_pipeline_step(config, ids, next, m, models::LlamaRankOptions{}.loss_reduction);
    EXPECT_NEAR(run.loss, ref.loss, 1e-6 * ref.loss);  // measured: 6e-8
    EXPECT_LT(largest_gradient_difference(run, ref), 1e-4);  // measured: 7e-7
  }
  const LlamaStep means = llama_pipeline_step(config, ids, next, 2, LossReduction::kMeanOfMicroBatches);
  EXPECT_GT(std::abs(means.loss - ref.loss), 1e-3 * ref.loss);  // measured: 2.3e-3
  EXPECT_GT(largest_gradient_difference(means, ref), 0.1);         // measured: 0.6
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
