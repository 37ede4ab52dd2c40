// PipelineOptions::tied_parameters: an input embedding on the first stage tied to the output head on the last (as
// a tied LLaMa's), held as two copies -- on two ranks, on one rank (zb-v), with ranks in between that hold none, over
// 2 replicas -- against one process's model whose head IS its embedding, in float64: the loss, every parameter's
// .grad (each copy's the tied weight's), the gradient norm (counted once), and the weights after clipped AdamW
// steps (the copies stay one weight). Construction gives the head the embedding's values; malformed ties are
// refused on every rank. Part of pipeline_test.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/nn/modules.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int64_t kVocab = 7, kWidth = 4, kTokens = 3, kSequences = 4;

// Stage s of S: the first embeds ids, every stage applies tanh(Linear), the last projects onto the vocabulary.
struct TiedChunkImpl : torch::nn::Module {
  TiedChunkImpl(int s, int stages) : first(s == 0), last(s == stages - 1) {
    torch::manual_seed(300 + s);
    if (first) embed = register_module("embed", twobp::nn::Embedding(kVocab, kWidth));
    mix = register_module("mix", twobp::nn::Linear(kWidth, kWidth));
    if (last) head = register_module("head", twobp::nn::Linear(twobp::nn::LinearOptions(kWidth, kVocab).bias(false)));
  }
  // `tied`: the reference's head weight (the embedding's tensor) in place of this chunk's own.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& tied = {}) {
    torch::Tensor h = torch::tanh(mix->forward(first ? embed->forward(x) : x));
    if (!last) return h;
    return tied.defined() ? torch::nn::functional::linear(h, tied) : head->forward(h);
  }
  bool first, last;
  twobp::nn::Embedding embed{nullptr};
  twobp::nn::Linear mix{nullptr}, head{nullptr};
};
TORCH_MODULE(TiedChunk);

torch::Tensor token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

struct Batch {
  torch::Tensor ids, targets;
};
Batch batch() {
  torch::manual_seed(11);
  return {torch::randint(kVocab, {kSequences, kTokens}, torch::kLong),
          torch::randint(kVocab, {kSequences, kTokens}, torch::kLong)};
}

constexpr double kLr = 0.05, kMaxNorm = 0.05;  // a norm well below the gradients': clipping is active
constexpr int kSteps = 2;

// By parameter name over the whole model ("s.<stage>.<name>"): gradients after the first step, weights at the end.
struct Outcome {
  double loss = 0.0, norm = 0.0;
  std::map<std::string, torch::Tensor> grads, weights;
};

// The tied model in one process: the head's weight is the embedding's tensor.
Outcome reference(int stages, int micro_batches) {
  std::vector<TiedChunk> chunks;
  for (int s = 0; s < stages; ++s) chunks.emplace_back(s, stages);
  const torch::Tensor tied = chunks[0]->embed->weight;
  std::vector<torch::Tensor> params;  // the head's own weight is not the model's
  for (auto& c : chunks) {
    for (auto& p : c->parameters()) {
      if (!c->last || !p.is_same(c->head->weight)) params.push_back(p);
    }
  }
  // What the pipeline's head copy must hold: the tied weight's gradient and values.
  const auto name_of = [&](int s, const std::string& key, const torch::Tensor& p) {
    return std::make_pair("s" + std::to_string(s) + "." + key, chunks[s]->last && p.is_same(chunks[s]->head->weight)
                                                                   ? tied : p);
  };
  torch::optim::AdamW adam(params, torch::optim::AdamWOptions(kLr));
  const Batch b = batch();
  Outcome out;
  for (int step = 0; step < kSteps; ++step) {
    adam.zero_grad();
    double loss = 0.0;
    const auto ids = b.ids.split(kSequences / micro_batches), ys = b.targets.split(kSequences / micro_batches);
    for (int mb = 0; mb < micro_batches; ++mb) {
      torch::Tensor h = ids[mb];
      for (auto& c : chunks) h = c->forward(h, tied);
      torch::Tensor l = token_loss(h, ys[mb]) / micro_batches;
      l.backward();
      loss += l.item<double>();
    }
    const double norm = torch::nn::utils::clip_grad_norm_(params, kMaxNorm);
    if (step == 0) {
      out.loss = loss;
      out.norm = norm;
      for (int s = 0; s < stages; ++s) {
        for (const auto& item : chunks[s]->named_parameters()) {
          const auto [name, p] = name_of(s, item.key(), item.value());
          out.grads[name] = p.grad().clone();
        }
      }
    }
    adam.step();
  }
  for (int s = 0; s < stages; ++s) {
    for (const auto& item : chunks[s]->named_parameters()) {
      const auto [name, p] = name_of(s, item.key(), item.value());
      out.weights[name] = p.detach().clone();
    }
  }
  return out;
}

std::vector<TiedParameter> embedding_tie(int stages) {
  return {TiedParameter{"embedding", {{0, "embed.weight"}, {stages - 1, "head.weight"}}}};
}

// dp replicas of `ranks` pipeline ranks under `name`, the tie declared, kSteps clipped AdamW steps.
Outcome run_tied(const std::string& name, BackwardMode mode, int ranks, int v, int micro_batches, int dp) {
  const Schedule schedule = make_schedule(name, ScheduleOptions{ranks, micro_batches, v, mode});
  const int stages = schedule.num_stages;
  const int64_t share = kSequences / dp, mbs = share / micro_batches;
  auto transports = make_local_transports(ranks * dp);
  std::vector<std::vector<TiedChunk>> built(ranks * dp);  // built here: one generator, one thread
  for (int w = 0; w < ranks * dp; ++w) {
    for (int s : schedule.stages_of(w % ranks)) built[w].emplace_back(s, stages);
  }
  const Batch b = batch();
  Outcome out;
  std::mutex mutex;
  const RankErrors errors = run_rank_threads(transports, [&](Transport& world) {
    ParallelGroups groups(world, dp, std::chrono::seconds(60));
    const int r = groups.pipeline_rank(), replica = groups.replica();
    PipelineOptions o;
    o.loss = token_loss;
    o.executor.timeout = std::chrono::seconds(60);
    o.executor.activation_spec = [mbs](int) { return TensorSpec{{mbs, kTokens, kWidth}, at::kDouble}; };
    o.data_parallel.group = groups.data_parallel();
    o.tied_parameters = embedding_tie(stages);
    std::vector<PipelineChunk> mine;
    const std::vector<int> my_stages = schedule.stages_of(r);
    for (std::size_t k = 0; k < my_stages.size(); ++k) {
      TiedChunk c = built[world.rank()][k];
      mine.push_back({my_stages[k], c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }});
    }
    Pipeline pipeline(schedule, std::move(mine), groups.pipeline(), o);
    torch::optim::AdamW adam(pipeline.parameters(), torch::optim::AdamWOptions(kLr));
    const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, replica * share, share); };
    const bool first = schedule.stage_to_rank[0] == r, last = schedule.stage_to_rank[stages - 1] == r;
    for (int step = 0; step < kSteps; ++step) {
      pipeline.zero_grad();
      const StepResult result = pipeline.step(first ? NamedTensors(rows(b.ids)) : NamedTensors(),
                                              last ? NamedTensors(rows(b.targets)) : NamedTensors());
      const double loss = pipeline.mean_loss(result);
      ASSERT_TRUE(pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop, kMaxNorm));
      std::lock_guard<std::mutex> lock(mutex);
      if (step == 0 && replica == 0) {
        out.loss = loss;
        out.norm = pipeline.last_gradient_check().norm;
        for (std::size_t k = 0; k < my_stages.size(); ++k) {
          for (const auto& item : built[world.rank()][k]->named_parameters()) {
            out.grads["s" + std::to_string(my_stages[k]) + "." + item.key()] = item.value().grad().clone();
          }
        }
      }
      adam.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (replica == 0) {
      for (std::size_t k = 0; k < my_stages.size(); ++k) {
        for (const auto& item : built[world.rank()][k]->named_parameters()) {
          out.weights["s" + std::to_string(my_stages[k]) + "." + item.key()] = item.value().detach().clone();
        }
      }
    }
  });
  if (!errors.ok()) errors.rethrow_root_cause();
  return out;
}

void expect_same(const Outcome& run, const Outcome& ref, int stages) {
  EXPECT_NEAR(run.loss, ref.loss, 1e-12 * std::abs(ref.loss));
  EXPECT_NEAR(run.norm, ref.norm, 1e-12 * ref.norm) << "the tied weight counts once in the norm";
  const std::string head = "s" + std::to_string(stages - 1) + ".head.weight";
  for (auto what : {&Outcome::grads, &Outcome::weights}) {
    const auto& mine = run.*what;
    const auto& theirs = ref.*what;
    ASSERT_EQ(mine.size(), theirs.size());
    for (const auto& [name, t] : theirs) {
      ASSERT_EQ(mine.count(name), 1u) << name;
      EXPECT_TRUE(torch::allclose(mine.at(name), t, 1e-12, 1e-14)) << name;
    }
    EXPECT_TRUE(torch::equal(mine.at("s0.embed.weight"), mine.at(head))) << "the copies are bitwise one weight";
  }
}

TEST(TiedParameters, CopiesOnTwoStagesTrainAsTheTiedWeight) {
  Float64Default float64;
  struct Case {
    std::string name;
    int ranks, v, dp;
  };
  // Copies on two ranks; on one rank (zb-v: stages 0 and 3 on rank 0); with ranks that hold none (4 ranks);
  // interleaved (stage 3 on rank 1); over 2 replicas.
  for (const Case& c : std::vector<Case>{{"1f1b", 2, 1, 1}, {"zb-v", 2, 2, 1}, {"1f1b", 4, 1, 1},
                                         {"interleaved-1f1b", 2, 2, 1}, {"zb-h1", 2, 1, 2}}) {
    for (const BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
      SCOPED_TRACE(c.name + " " + to_string(mode) + " ranks " + std::to_string(c.ranks) + " dp " +
                   std::to_string(c.dp));
      const int stages = c.ranks * c.v, m = 2;
      const Outcome ref = reference(stages, m * c.dp);
      expect_same(run_tied(c.name, mode, c.ranks, c.v, m, c.dp), ref, stages);
    }
  }
}

// Each rank's Pipeline over `ties`; returns the error of rank 0 (every rank must fail).
void expect_refused(const std::vector<TiedParameter>& ties, const std::vector<std::string>& words) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  std::vector<TiedChunk> chunks{TiedChunk(0, 2), TiedChunk(1, 2)};
  if (ties.size() == 1 && ties[0].name == "shape") {
    chunks[1]->head->weight.set_data(torch::zeros({kVocab, kWidth + 1}));
  }
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    PipelineOptions o;
    o.loss = token_loss;
    o.executor.timeout = std::chrono::seconds(60);
    o.tied_parameters = ties;
    TiedChunk c = chunks[t.rank()];
    std::vector<PipelineChunk> mine{{t.rank(), c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }}};
    Pipeline pipeline(schedule, std::move(mine), t, o);
  });
  ASSERT_FALSE(errors.ok());
  std::string messages;  // every rank fails, none waits; one says what is wrong
  bool found = false;
  for (const auto& e : errors.errors) {
    ASSERT_TRUE(e != nullptr) << "a rank did not fail";
    try {
      std::rethrow_exception(e);
    } catch (const UsageError& u) {
      const std::string what = u.what();
      messages += what + "\n";
      bool all = true;
      for (const auto& w : words) all = all && what.find(w) != std::string::npos;
      found = found || all;
    } catch (const std::exception& other) {
      messages += std::string(other.what()) + "\n";
    }
  }
  EXPECT_TRUE(found) << "no rank's UsageError holds every one of the words; they said:\n" << messages;
}

TEST(TiedParameters, MalformedTiesAreRefusedOnEveryRank) {
  expect_refused({{"one", {{0, "embed.weight"}}}}, {"'one'", "at least two"});
  expect_refused({{"twice", {{0, "embed.weight"}, {0, "mix.weight"}}}}, {"stage 0 is listed twice"});
  expect_refused({{"far", {{0, "embed.weight"}, {5, "head.weight"}}}}, {"stage 5 is not a stage"});
  expect_refused({{"typo", {{0, "embed.weight"}, {1, "head.weigth"}}}}, {"rank 1", "no parameter 'head.weigth'"});
  expect_refused({{"shape", {{0, "embed.weight"}, {1, "head.weight"}}}}, {"'shape'", "copies differ", "shape [7, 5]"});
}

TEST(TiedParameters, ConstructionGivesEveryCopyTheFirstCopysValues) {
  Float64Default float64;
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  std::vector<TiedChunk> chunks{TiedChunk(0, 2), TiedChunk(1, 2)};
  ASSERT_FALSE(torch::equal(chunks[0]->embed->weight, chunks[1]->head->weight));
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    PipelineOptions o;
    o.loss = token_loss;
    o.executor.timeout = std::chrono::seconds(60);
    o.tied_parameters = embedding_tie(2);
    TiedChunk c = chunks[t.rank()];
    std::vector<PipelineChunk> mine{{t.rank(), c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }}};
    Pipeline pipeline(schedule, std::move(mine), t, o);
  });
  if (!errors.ok()) errors.rethrow_root_cause();
  EXPECT_TRUE(torch::equal(chunks[0]->embed->weight, chunks[1]->head->weight));
}

}  // namespace
}  // namespace twobp::testing
