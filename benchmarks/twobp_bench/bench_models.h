#pragma once
// Models for the benchmarks. The LLaMa-style stack is written once over a "layer kind" so that the fast path
// (twobp::nn::Linear / RMSNorm: weight gradients through the WeightGradStore) and the general path
// (torch::nn::Linear and an RMSNorm made of ordinary ops: weight gradients through the autograd-graph split)
// run exactly the same architecture, shapes and initial weights.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "twobp/nn.h"

namespace twobp::bench {

struct LlamaConfig {
  int64_t dim = 512;
  int64_t ffn = 1376;
  int64_t heads = 8;
  int64_t kv_heads = 4;
  int64_t layers = 2;
  int64_t max_seq = 128;
};

/// RMSNorm from ordinary differentiable ops (general path): x * rsqrt(mean(x^2) + eps) * weight.
struct GeneralRMSNormImpl : torch::nn::Module {
  explicit GeneralRMSNormImpl(int64_t dim, double eps = 1e-6) : eps(eps) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
  }
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(GeneralRMSNorm);

/// Fast path: every weight-bearing layer is a twobp::nn layer.
struct FastLayers {
  using Linear = twobp::nn::Linear;
  using Norm = twobp::nn::RMSNorm;
  static Linear linear(int64_t in, int64_t out) { return Linear(twobp::nn::LinearOptions(in, out).bias(false)); }
  static Norm norm(int64_t dim) { return Norm(dim); }
};

/// General path: LibTorch's own Linear and an op-composed RMSNorm.
struct GeneralLayers {
  using Linear = torch::nn::Linear;
  using Norm = GeneralRMSNorm;
  static Linear linear(int64_t in, int64_t out) { return Linear(torch::nn::LinearOptions(in, out).bias(false)); }
  static Norm norm(int64_t dim) { return Norm(dim); }
};

/// LLaMa decoder block: RMSNorm, rotary causal grouped-query attention (SDPA), RMSNorm, SwiGLU MLP.
template <typename L>
struct LlamaBlock : torch::nn::Module {
  LlamaBlock(const LlamaConfig& c, std::shared_ptr<const twobp::nn::RotaryEmbedding> rotary)
      : dim(c.dim), heads(c.heads), kv_heads(c.kv_heads), head_dim(c.dim / c.heads), rotary(std::move(rotary)) {
    attn_norm = register_module("attn_norm", L::norm(dim));
    wq = register_module("wq", L::linear(dim, dim));
    wk = register_module("wk", L::linear(dim, kv_heads * head_dim));
    wv = register_module("wv", L::linear(dim, kv_heads * head_dim));
    wo = register_module("wo", L::linear(dim, dim));
    mlp_norm = register_module("mlp_norm", L::norm(dim));
    w1 = register_module("w1", L::linear(dim, c.ffn));
    w3 = register_module("w3", L::linear(dim, c.ffn));
    w2 = register_module("w2", L::linear(c.ffn, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1);
    auto h = attn_norm(x);
    auto q = (*rotary)(wq(h).view({b, s, heads, head_dim}).transpose(1, 2));
    auto k = (*rotary)(wk(h).view({b, s, kv_heads, head_dim}).transpose(1, 2));
    auto v = wv(h).view({b, s, kv_heads, head_dim}).transpose(1, 2);
    if (heads != kv_heads) {
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
    auto a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    auto y = x + wo(a.transpose(1, 2).reshape({b, s, dim}));
    auto m = mlp_norm(y);
    return y + w2(torch::silu(w1(m)) * w3(m));
  }
  int64_t dim, heads, kv_heads, head_dim;
  std::shared_ptr<const twobp::nn::RotaryEmbedding> rotary;  ///< both paths: one autograd node per use
  typename L::Norm attn_norm{nullptr}, mlp_norm{nullptr};
  typename L::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, w1{nullptr}, w2{nullptr}, w3{nullptr};
};

/// `layers` blocks: one pipeline stage of a LLaMa-style model. Input and output: [batch, seq, dim].
template <typename L>
struct LlamaStack : torch::nn::Module {
  explicit LlamaStack(const LlamaConfig& c) {
    auto rotary = std::make_shared<const twobp::nn::RotaryEmbedding>(c.dim / c.heads, 10000.0, c.max_seq);
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<LlamaBlock<L>>(c, rotary)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = block->forward(x);
    return x;
  }
  std::vector<std::shared_ptr<LlamaBlock<L>>> blocks;
};

/// General path with convolutions and batch norm: `layers` residual blocks conv-BN-ReLU-conv on [B, C, H, W].
struct ConvStackImpl : torch::nn::Module {
  ConvStackImpl(int64_t channels, int64_t layers) {
    for (int64_t i = 0; i < layers; ++i) {
      const auto n = std::to_string(i);
      conv1.push_back(register_module(
          "conv1_" + n, torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).padding(1).bias(false))));
      bn.push_back(register_module("bn_" + n, torch::nn::BatchNorm2d(channels)));
      conv2.push_back(register_module("conv2_" + n,
                                      torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).padding(1))));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < conv1.size(); ++i) x = x + conv2[i](torch::relu(bn[i](conv1[i](x))));
    return x;
  }
  std::vector<torch::nn::Conv2d> conv1, conv2;
  std::vector<torch::nn::BatchNorm2d> bn;
};
TORCH_MODULE(ConvStack);

}  // namespace twobp::bench
