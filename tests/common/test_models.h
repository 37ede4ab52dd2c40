#pragma once
// Small models shared by the tests: one per kind of layer the 2BP split must handle.

#include <torch/torch.h>

#include "twobp/nn.h"

namespace twobp::testing {

/// The tests' loss: mean squared error.
inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return (out - target).pow(2).mean(); }

/// Makes float64 the default dtype while alive (parity tests compare in float64), float32 again afterwards.
struct Float64Default {
  Float64Default() { torch::set_default_dtype(caffe2::TypeMeta::Make<double>()); }
  ~Float64Default() { torch::set_default_dtype(caffe2::TypeMeta::Make<float>()); }
  Float64Default(const Float64Default&) = delete;
  Float64Default& operator=(const Float64Default&) = delete;
};

/// Fast path: twobp::nn::Linear layers.
struct FastMlpImpl : torch::nn::Module {
  explicit FastMlpImpl(int64_t dim, int64_t hidden = 0) {
    hidden = hidden > 0 ? hidden : 2 * dim;
    fc1 = register_module("fc1", twobp::nn::Linear(dim, hidden));
    fc2 = register_module("fc2", twobp::nn::Linear(twobp::nn::LinearOptions(hidden, dim).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))) + x; }
  twobp::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(FastMlp);

/// General path: LibTorch's own Linear.
struct TorchMlpImpl : torch::nn::Module {
  explicit TorchMlpImpl(int64_t dim) {
    fc1 = register_module("fc1", torch::nn::Linear(dim, 2 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(2 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))) * 0.5 + x; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TorchMlp);

/// Rotary position embedding on [batch, heads, seq, head_dim].
inline torch::Tensor apply_rotary(const torch::Tensor& x, double theta = 10000.0) {
  const int64_t seq = x.size(2), half = x.size(3) / 2;
  auto opts = x.options();
  auto inv_freq = torch::pow(theta, -torch::arange(0, half, opts) / static_cast<double>(half));
  auto angles = torch::outer(torch::arange(seq, opts), inv_freq);  // [seq, half]
  auto cos = torch::cos(angles), sin = torch::sin(angles);
  auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * cos - x2 * sin, x1 * sin + x2 * cos}, -1);
}

/// LLaMa-style decoder block from fast-path layers: RMSNorm, rotary causal attention with grouped-query heads
/// (scaled dot-product attention), SwiGLU MLP.
struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl(int64_t dim, int64_t heads, int64_t kv_heads, int64_t ffn)
      : dim(dim), heads(heads), kv_heads(kv_heads), head_dim(dim / heads) {
    attn_norm = register_module("attn_norm", twobp::nn::RMSNorm(dim));
    wq = register_module("wq", twobp::nn::Linear(twobp::nn::LinearOptions(dim, dim).bias(false)));
    wk = register_module("wk", twobp::nn::Linear(twobp::nn::LinearOptions(dim, kv_heads * head_dim).bias(false)));
    wv = register_module("wv", twobp::nn::Linear(twobp::nn::LinearOptions(dim, kv_heads * head_dim).bias(false)));
    wo = register_module("wo", twobp::nn::Linear(twobp::nn::LinearOptions(dim, dim).bias(false)));
    mlp_norm = register_module("mlp_norm", twobp::nn::RMSNorm(dim));
    w1 = register_module("w1", twobp::nn::Linear(twobp::nn::LinearOptions(dim, ffn).bias(false)));
    w3 = register_module("w3", twobp::nn::Linear(twobp::nn::LinearOptions(dim, ffn).bias(false)));
    w2 = register_module("w2", twobp::nn::Linear(twobp::nn::LinearOptions(ffn, dim).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1);
    auto h = attn_norm(x);
    auto q = wq(h).view({b, s, heads, head_dim}).transpose(1, 2);
    auto k = wk(h).view({b, s, kv_heads, head_dim}).transpose(1, 2);
    auto v = wv(h).view({b, s, kv_heads, head_dim}).transpose(1, 2);
    q = apply_rotary(q);
    k = apply_rotary(k);
    const int64_t rep = heads / kv_heads;
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
    auto a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    auto y = x + wo(a.transpose(1, 2).reshape({b, s, dim}));
    auto m = mlp_norm(y);
    return y + w2(torch::silu(w1(m)) * w3(m));
  }
  int64_t dim, heads, kv_heads, head_dim;
  twobp::nn::RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  twobp::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(TinyBlock);

/// General path with convolutions and batch norm (buffers updated in forward).
struct ConvNetImpl : torch::nn::Module {
  explicit ConvNetImpl(int64_t channels) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, 8, 3).padding(1)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(8));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, channels, 3).padding(1)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return conv2(torch::relu(bn1(conv1(x)))) + x; }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
};
TORCH_MODULE(ConvNet);

/// First stage of a language model: embedding (repeated ids) and a tied output head.
struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl(int64_t vocab, int64_t dim) {
    embed = register_module("embed", twobp::nn::Embedding(vocab, dim));
    norm = register_module("norm", twobp::nn::RMSNorm(dim));
    head = register_module("head", twobp::nn::Linear(twobp::nn::LinearOptions(dim, vocab).bias(false)));
    head->tie_weight(embed->weight);
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(norm(embed(ids))); }
  twobp::nn::Embedding embed{nullptr};
  twobp::nn::RMSNorm norm{nullptr};
  twobp::nn::Linear head{nullptr};
};
TORCH_MODULE(TiedLm);

/// A custom module with a registered buffer used in forward and a parameter used twice.
struct BufferedImpl : torch::nn::Module {
  explicit BufferedImpl(int64_t dim) {
    scale = register_parameter("scale", torch::randn({dim}));
    shift = register_buffer("shift", torch::randn({dim}));
    mix = register_module("mix", torch::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::sigmoid(mix(x * scale + shift));
    return h * scale + x;
  }
  torch::Tensor scale, shift;
  torch::nn::Linear mix{nullptr};
};
TORCH_MODULE(Buffered);

}  // namespace twobp::testing
