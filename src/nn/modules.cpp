#include "twobp/nn/modules.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

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
  TORCH_CHECK(shared.sizes() == weight.sizes(), "tie_weight: shape ", shared.sizes(), " differs from ",
              weight.sizes());
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
  return functional::rms_norm(input, weight, options.eps(), *this);
}

void RMSNormImpl::accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const {
  functional::rms_norm_weight_grad(weight, items);
}

DropoutImpl::DropoutImpl(const DropoutOptions& options_) : options(options_) { reset(); }

void DropoutImpl::reset() {
  // At construction, not only at the first forward in training mode.
  TWOBP_CHECK(options.p() >= 0.0 && options.p() <= 1.0, UsageError, "twobp::nn::Dropout: p must be in [0, 1], got {}",
              options.p());
}

at::Tensor DropoutImpl::forward(const at::Tensor& input) { return functional::dropout(input, options.p(), is_training()); }

}  // namespace twobp::nn
