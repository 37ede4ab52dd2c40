#pragma once
// A BERT-like encoder built from LibTorch's own layers (torch::nn: its weight gradients come from the general
// autograd-graph split), cut into pipeline chunks: `twobp_bench pipeline --model bert`.
//
// Architecture: token + learned position embeddings and LayerNorm (first chunk); post-LN blocks -- multi-head
// non-causal SDPA with biased Q/K/V/O projections, residual, LayerNorm, Linear-GELU-Linear, residual, LayerNorm;
// an MLM head (Linear, GELU, LayerNorm, Linear to the vocabulary; last chunk). Stage s of S holds blocks
// even_blocks(layers, s, S). Initialisation is keyed by (seed, parameter name), so the weights are the same
// whatever the partition, thread or process that builds them.
// Construction still draws from LibTorch's default generator (torch::nn layers initialise themselves before the
// name-keyed values replace theirs): with ranks as threads, build every rank's chunks before any rank steps.

#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace twobp::models {

/// Blocks [first, end) of stage `stage` of `num_stages` when `layers` blocks are split evenly:
/// [stage·layers/num_stages, (stage+1)·layers/num_stages) (integer division; sizes differ by at most one).
std::pair<int64_t, int64_t> even_blocks(int64_t layers, int stage, int num_stages);

struct BertConfig {
  int64_t dim = 256, layers = 4, heads = 4, ffn = 688, vocab = 256, seq = 128;
  /// UsageError naming the field unless every size is positive, heads divides dim and every one of `num_stages`
  /// stages holds a block.
  void validate(int num_stages) const;
};

/// One post-LN encoder block on [batch, seq, dim].
class BertLayerImpl : public torch::nn::Module {
 public:
  BertLayerImpl(int64_t dim, int64_t heads, int64_t ffn);
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t dim_, heads_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
  torch::nn::LayerNorm attn_norm_{nullptr}, ffn_norm_{nullptr};
  torch::nn::GELU gelu_;
};
TORCH_MODULE(BertLayer);

/// Stage `stage` of `num_stages`: token ids [batch, seq] int64 in (first stage) or hidden states [batch, seq, dim];
/// hidden states out, or logits [batch, seq, vocab] from the last stage.
class BertChunkImpl : public torch::nn::Module {
 public:
  BertChunkImpl(const BertConfig& config, int stage, int num_stages, uint64_t seed = 0);
  at::Tensor forward(const at::Tensor& input);

 private:
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  torch::nn::LayerNorm embed_norm_{nullptr}, head_norm_{nullptr};
  std::vector<BertLayer> layers_;
  torch::nn::Linear head_dense_{nullptr}, decoder_{nullptr};
  torch::nn::GELU gelu_;
};
TORCH_MODULE(BertChunk);

}  // namespace twobp::models
