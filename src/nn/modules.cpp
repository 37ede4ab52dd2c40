#include "twobp/nn/modules.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/ranges.h>

#include <cmath>

#include "twobp/nn/functional.h"
#include "util/check.h"

namespace twobp::nn {

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_) { reset(); }

void LinearImpl::reset() {
  weight = register_parameter("weight", at::empty({options.out_features(), options.in_features()}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features()}))
                        : register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  // torch::nn::Linear's kaiming_uniform_(a = sqrt(5)) reduces to U(-1/sqrt(in), 1/sqrt(in)) for both tensors.
  const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
  c10::AutoGradMode no_grad(false);
  weight.uniform_(-bound, bound);
  if (bias.defined()) bias.uniform_(-bound, bound);
}

at::Tensor LinearImpl::forward(const at::Tensor& input) { return functional::linear(input, weight, bias, *this); }

void LinearImpl::accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const {
  functional::linear_weight_grad(weight, bias, items);
}

void LinearImpl::tie_weight(const at::Tensor& shared) {
  TWOBP_CHECK(shared.sizes() == weight.sizes(), UsageError, "tie_weight: shape [{}] differs from the weight's [{}]",
              fmt::join(shared.sizes(), ", "), fmt::join(weight.sizes(), ", "));
  parameters_["weight"] = shared;
  weight = shared;
}

EmbeddingImpl::EmbeddingImpl(const EmbeddingOptions& options_) : options(options_) { reset(); }

void EmbeddingImpl::reset() {
  weight = register_parameter("weight", at::empty({options.num_embeddings(), options.embedding_dim()}));
  c10::AutoGradMode no_grad(false);
  weight.normal_(0.0, 1.0);
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) { return functional::embedding(ids, weight, *this); }

void EmbeddingImpl::accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const {
  functional::embedding_weight_grad(weight, items);
}

RMSNormImpl::RMSNormImpl(const RMSNormOptions& options_) : options(options_) { reset(); }

void RMSNormImpl::reset() { weight = register_parameter("weight", at::ones({options.dim()})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& input) {
  return functional::rms_norm(input, weight, options.eps(), *this, options.fused_on_cuda());
}

void RMSNormImpl::accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const {
  functional::rms_norm_weight_grad(weight, items);
}

at::Tensor rotary_inverse_frequencies(int64_t head_dim, double theta) {
  TWOBP_CHECK(head_dim > 0 && head_dim % 2 == 0, UsageError,
              "RotaryEmbedding: the head dimension must be positive and even, got {}", head_dim);
  c10::AutoGradMode no_grad(false);
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), where `1.0 / t` is
  // t.reciprocal() * 1.0 -- the same float32 operations here, hence the same bits.
  const auto fopts = at::TensorOptions().dtype(at::kFloat);
  return at::reciprocal(at::pow(theta, at::arange(0, head_dim, 2, fopts) / static_cast<double>(head_dim)));
}

RotaryEmbedding::RotaryEmbedding(int64_t head_dim, double theta, int64_t max_positions)
    : RotaryEmbedding(rotary_inverse_frequencies(head_dim, theta), max_positions) {}

RotaryEmbedding::RotaryEmbedding(at::Tensor inverse_frequencies, int64_t max_positions)
    : head_dim_(inverse_frequencies.dim() == 1 ? 2 * inverse_frequencies.size(0) : 0),
      inv_freq_(inverse_frequencies.detach().to(at::kCPU).contiguous()),
      max_positions_(max_positions) {
  TWOBP_CHECK(inverse_frequencies.dim() == 1 && inverse_frequencies.size(0) > 0 &&
                  inverse_frequencies.scalar_type() == at::kFloat,
              UsageError, "RotaryEmbedding: inverse frequencies must be float32 [head_dim / 2], got {} of {} "
              "dimensions", c10::toString(inverse_frequencies.scalar_type()), inverse_frequencies.dim());
}

const RotaryEmbedding::Tables& RotaryEmbedding::cached(const at::Tensor& x, int64_t length) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : entries_) {
    if (e->length == length && e->dtype == x.scalar_type() && e->device == x.device()) return e->tables;
  }
  c10::AutoGradMode no_grad(false);
  const auto fopts = at::TensorOptions().dtype(at::kFloat);
  // The angles, cos and sin in float32 on the CPU whatever x's dtype, as transformers computes them (position ·
  // inv_freq, one float32 product each), then cast to x's dtype.
  const at::Tensor angles = at::outer(at::arange(length, fopts), inv_freq_);
  const at::Tensor cos = at::cos(angles), sin = at::sin(angles);
  const auto to_x = x.options().requires_grad(false);
  Tables t{at::cat({cos, cos}, -1).to(to_x), at::cat({-sin, sin}, -1).to(to_x)};
  entries_.push_back(std::make_unique<Entry>(Entry{x.device(), x.scalar_type(), length, std::move(t)}));
  return entries_.back()->tables;
}

RotaryEmbedding::Tables RotaryEmbedding::tables(const at::Tensor& x, const at::Tensor& positions) const {
  TWOBP_CHECK(x.dim() == 4 && x.size(3) == head_dim_, UsageError,
              "RotaryEmbedding: expected x of [batch, heads, seq, {}], got {} dimensions (last {})", head_dim_,
              x.dim(), x.dim() > 0 ? x.size(-1) : 0);
  const int64_t seq = x.size(2);
  if (!positions.defined()) return cached(x, seq);
  const Tables& all = cached(x, std::max(seq, max_positions_));
  const at::Tensor flat = positions.reshape({-1});
  const std::vector<int64_t> shape = {positions.size(0), 1, positions.size(1), head_dim_};
  return {all.cos.index_select(0, flat).view(shape), all.sin_signed.index_select(0, flat).view(shape)};
}

at::Tensor RotaryEmbedding::operator()(const at::Tensor& x, const at::Tensor& positions) const {
  const Tables t = tables(x, positions);
  return functional::rotary_embedding(x, t.cos, t.sin_signed);
}

DropoutImpl::DropoutImpl(const DropoutOptions& options_) : options(options_) { reset(); }

void DropoutImpl::reset() {
  // At construction, not only at the first forward in training mode.
  TWOBP_CHECK(options.p() >= 0.0 && options.p() <= 1.0, UsageError, "twobp::nn::Dropout: p must be in [0, 1], got {}",
              options.p());
}

at::Tensor DropoutImpl::forward(const at::Tensor& input) { return functional::dropout(input, options.p(), is_training()); }

}  // namespace twobp::nn
