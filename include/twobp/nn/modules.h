#pragma once
// Drop-in fast-path modules: twobp::nn::Linear, Embedding and RMSNorm behave like their LibTorch counterparts
// (same parameters, same initialisation scheme, same results) and additionally support the 2BP split.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include "twobp/autograd/weight_grad_store.h"

#include <memory>
#include <mutex>
#include <vector>

namespace twobp::nn {

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features) : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
};

/// y = x W^T + b, with W of shape [out, in]; initialised like torch::nn::Linear (uniform ±1/sqrt(in)).
class LinearImpl : public torch::nn::Cloneable<LinearImpl>, public autograd::WeightGradKernel {
 public:
  LinearImpl(int64_t in_features, int64_t out_features) : LinearImpl(LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const LinearOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);
  void accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const override;
  std::string kernel_name() const override { return "Linear"; }
  std::vector<at::Tensor> weight_grad_parameters() const override { return {weight, bias}; }
  /// Makes this layer use `shared` (e.g. the embedding table, for tied input/output embeddings) as its weight.
  /// Both layers then accumulate into the same .grad, so the gradient is the sum over every use. UsageError when
  /// the shapes differ.
  void tie_weight(const at::Tensor& shared);

  LinearOptions options;
  at::Tensor weight;
  at::Tensor bias;  ///< undefined when options.bias() is false
};
TORCH_MODULE(Linear);

struct EmbeddingOptions {
  EmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
};

/// Token embedding with a dense weight gradient (index_add over the looked-up rows); initialised N(0, 1).
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl>, public autograd::WeightGradKernel {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(const EmbeddingOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& ids);
  void accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const override;
  std::string kernel_name() const override { return "Embedding"; }
  std::vector<at::Tensor> weight_grad_parameters() const override { return {weight}; }

  EmbeddingOptions options;
  at::Tensor weight;
};
TORCH_MODULE(Embedding);

struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, eps) = 1e-6;
  /// On CUDA, LibTorch's fused kernels (functional::rms_norm); composite ops when false, and always on the CPU.
  TORCH_ARG(bool, fused_on_cuda) = true;
};

/// Root-mean-square normalisation over the last dimension with a learned scale (LLaMa); scale initialised to 1.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl>, public autograd::WeightGradKernel {
 public:
  explicit RMSNormImpl(int64_t dim) : RMSNormImpl(RMSNormOptions(dim)) {}
  explicit RMSNormImpl(const RMSNormOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);
  void accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const override;
  std::string kernel_name() const override { return "RMSNorm"; }
  std::vector<at::Tensor> weight_grad_parameters() const override { return {weight}; }

  RMSNormOptions options;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// Rotary inverse frequencies for head dimension `head_dim` (positive, even): float32 [head_dim / 2],
/// inv_freq[i] = 1 / theta^(2i / head_dim), computed op for op as transformers computes them (float32 arange
/// divided by head_dim, theta raised to it, reciprocal), so that a model imported from transformers gets bitwise
/// the same rotary tables as it has there.
at::Tensor rotary_inverse_frequencies(int64_t head_dim, double theta = 10000.0);

/// The tables of functional::rotary_embedding: angle(position, i) = position · inv_freq[i] (by default
/// rotary_inverse_frequencies(head_dim, theta)), cos and sin computed once in float32 on the CPU and kept per
/// device, dtype and sequence length, so a forward does no trigonometry and no host-to-device copy. For positions
/// 0..seq-1 these equal transformers' tables bitwise (LlamaRotaryEmbedding: float32 angles, cos and sin, then cast
/// to the activations' dtype). Not a module: no parameters, no buffers (nothing enters a checkpoint), so one can
/// serve every block of a chunk. Thread-safe.
class RotaryEmbedding {
 public:
  /// `max_positions`: the longest table kept (grown when a longer sequence comes); positions must be below
  /// max(max_positions, the sequence length).
  explicit RotaryEmbedding(int64_t head_dim, double theta = 10000.0, int64_t max_positions = 0);
  /// Tables of given inverse frequencies (float32 [head_dim / 2]; e.g. scaled for long contexts, as
  /// models::rope_inverse_frequencies does). UsageError for another shape or dtype.
  explicit RotaryEmbedding(at::Tensor inverse_frequencies, int64_t max_positions = 0);
  /// The inverse frequencies (float32 [head_dim / 2], CPU).
  const at::Tensor& inverse_frequencies() const { return inv_freq_; }
  RotaryEmbedding(const RotaryEmbedding&) = delete;
  RotaryEmbedding& operator=(const RotaryEmbedding&) = delete;

  struct Tables {
    at::Tensor cos, sin_signed;  ///< [seq, head_dim] or, with positions, [batch, 1, seq, head_dim]
  };
  /// The tables for x [batch, heads, seq, head_dim] (x's device and dtype): of positions 0..seq−1, or of
  /// `positions` ([batch, seq] int64) when defined. Compute them once for q and k.
  Tables tables(const at::Tensor& x, const at::Tensor& positions = {}) const;
  /// functional::rotary_embedding(x, tables(x, positions)).
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& positions = {}) const;

 private:
  struct Entry {
    c10::Device device;
    at::ScalarType dtype;
    int64_t length;
    Tables tables;
  };
  const Tables& cached(const at::Tensor& x, int64_t length) const;
  int64_t head_dim_;
  at::Tensor inv_freq_;
  int64_t max_positions_;
  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<Entry>> entries_;  // stable addresses: callers keep references
};

struct DropoutOptions {
  /* implicit */ DropoutOptions(double p = 0.5) : p_(p) {}  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, p);
};

/// Dropout for pipeline stages: functional::dropout in training mode, the identity in eval mode. Use it instead
/// of torch::nn::Dropout, which draws from the process-wide default generator (refused when ranks are threads of
/// one process; see twobp/random.h). Has no parameters: nothing for W.
class DropoutImpl : public torch::nn::Cloneable<DropoutImpl> {
 public:
  explicit DropoutImpl(const DropoutOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  DropoutOptions options;
};
TORCH_MODULE(Dropout);

}  // namespace twobp::nn
