#pragma once
// Shared by the Local and MPI pipeline tests: the chunks of a small pipeline and its single-process reference.

#include <torch/torch.h>

#include "common/test_models.h"
#include "twobp/runtime/pipeline.h"

namespace twobp::testing {

constexpr int64_t kDim = 4;
constexpr int64_t kMicroBatchSize = 2;

// Chunk s alternates between the fast path (twobp::nn::Linear) and the general path (torch::nn::Linear), so
// every pipeline exercises both halves of the split and their hand-over.
// `frozen`: every parameter of the chunk frozen (requires_grad false).
inline std::shared_ptr<torch::nn::Module> make_chunk(int s, bool frozen = false) {
  torch::manual_seed(100 + s);
  std::shared_ptr<torch::nn::Module> m;
  if (s % 2 == 0) {
    m = FastMlp(kDim).ptr();
  } else {
    m = TorchMlp(kDim).ptr();
  }
  if (frozen) {
    for (auto& p : m->parameters()) p.set_requires_grad(false);
  }
  return m;
}

inline torch::Tensor run_chunk(torch::nn::Module& m, int s, const torch::Tensor& x) {
  if (s % 2 == 0) return static_cast<FastMlpImpl&>(m).forward(x);
  return static_cast<TorchMlpImpl&>(m).forward(x);
}

// The options of these pipelines: the mse loss, float64 activations of [kMicroBatchSize, kDim] at every boundary,
// a 60 s timeout.
inline PipelineOptions fixture_options() {
  PipelineOptions o;
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  return o;
}

struct Reference {
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;
  std::vector<double> losses;
};

// `frozen_stages`: the first ones, entirely frozen (make_chunk's `frozen`).
inline Reference run_reference(int stages, int m, const torch::Tensor& inputs, const torch::Tensor& targets,
                               int frozen_stages = 0) {
  Reference ref;
  for (int s = 0; s < stages; ++s) ref.chunks.push_back(make_chunk(s, s < frozen_stages));
  auto xs = inputs.split(kMicroBatchSize), ys = targets.split(kMicroBatchSize);
  for (int mb = 0; mb < m; ++mb) {
    torch::Tensor h = xs[mb];
    for (int s = 0; s < stages; ++s) h = run_chunk(*ref.chunks[s], s, h);
    auto loss = mse(h, ys[mb]);
    (loss / m).backward();
    ref.losses.push_back(loss.item<double>());
  }
  return ref;
}

}  // namespace twobp::testing
