#pragma once
// Weights tied across pipeline stages (PipelineOptions::tied_parameters), shared by the Local and MPI tests: a model
// whose first stage embeds ids and whose last projects onto the vocabulary with a copy of the embedding, and its
// single-process reference whose head IS its embedding (float64, kSteps clipped AdamW steps).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/test_models.h"
#include "twobp/nn/modules.h"
#include "twobp/runtime/pipeline.h"

namespace twobp::testing::tied {

inline constexpr int64_t kVocab = 7, kWidth = 4, kTokens = 3, kSequences = 4;

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

inline torch::Tensor token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

struct Batch {
  torch::Tensor ids, targets;
};
inline Batch batch() {
  torch::manual_seed(11);
  return {torch::randint(kVocab, {kSequences, kTokens}, torch::kLong),
          torch::randint(kVocab, {kSequences, kTokens}, torch::kLong)};
}

inline constexpr double kLr = 0.05, kMaxNorm = 0.05;  // a norm well below the gradients': clipping is active
inline constexpr int kSteps = 2;

// By parameter name over the whole model ("s.<stage>.<name>"): gradients after the first step, weights at the end.
struct Outcome {
  double loss = 0.0, norm = 0.0;
  std::map<std::string, torch::Tensor> grads, weights;
};

// The tied model in one process: the head's weight is the embedding's tensor.
inline Outcome reference(int stages, int micro_batches) {
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

inline std::vector<TiedParameter> embedding_tie(int stages) {
  return {TiedParameter{"embedding", {{0, "embed.weight"}, {stages - 1, "head.weight"}}}};
}

// One rank's pipeline options for the tied model: the loss, boundaries of `mbs` sequences, the tie.
inline PipelineOptions tied_options(int stages, int64_t mbs) {
  PipelineOptions o;
  o.loss = token_loss;
  o.executor.timeout = std::chrono::seconds(60);
  o.executor.activation_spec = [mbs](int) { return TensorSpec{{mbs, kTokens, kWidth}, at::kDouble}; };
  o.tied_parameters = embedding_tie(stages);
  return o;
}

// `chunks` (this rank's, one per stage of `stages`) in `out` under "s<stage>.<name>": `grads` or `weights`.
inline void record(std::map<std::string, torch::Tensor>& out, const std::vector<int>& stages,
                   const std::vector<TiedChunk>& chunks, bool grads) {
  for (std::size_t k = 0; k < stages.size(); ++k) {
    for (const auto& item : chunks[k]->named_parameters()) {
      out["s" + std::to_string(stages[k]) + "." + item.key()] =
          grads ? item.value().grad().clone() : item.value().detach().clone();
    }
  }
}

// `run` against the reference: the loss and norm, and every tensor `run` holds -- all of the model's (`whole`) or
// one rank's part; where it holds both copies, they are bitwise one weight.
inline void expect_same(const Outcome& run, const Outcome& ref, int stages, bool whole = true) {
  EXPECT_NEAR(run.loss, ref.loss, 1e-12 * std::abs(ref.loss));
  EXPECT_NEAR(run.norm, ref.norm, 1e-12 * ref.norm) << "the tied weight counts once in the norm";
  const std::string head = "s" + std::to_string(stages - 1) + ".head.weight";
  for (auto what : {&Outcome::grads, &Outcome::weights}) {
    const auto& mine = run.*what;
    const auto& theirs = ref.*what;
    if (whole) ASSERT_EQ(mine.size(), theirs.size());
    ASSERT_FALSE(mine.empty());
    for (const auto& [name, t] : mine) {
      ASSERT_EQ(theirs.count(name), 1u) << name;
      EXPECT_TRUE(torch::allclose(t, theirs.at(name), 1e-12, 1e-14)) << name;
    }
    if (mine.count("s0.embed.weight") != 0 && mine.count(head) != 0) {
      EXPECT_TRUE(torch::equal(mine.at("s0.embed.weight"), mine.at(head))) << "the copies are bitwise one weight";
    }
  }
}

}  // namespace twobp::testing::tied
