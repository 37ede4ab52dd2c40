#include "twobp/nn/functional.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "twobp/random.h"
#include "util/check.h"

namespace twobp::nn::functional {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using autograd::WeightGradKernel;
using autograd::WeightGradStore;

// The store, kernel and micro-batch travel through AutogradContext::saved_data as integers. Lifetime contract:
// Stage owns the module (hence the kernel) and the store, and releases every graph before destroying either.
template <typename T>
std::int64_t to_handle(const T* p) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(p));
}
template <typename T>
T* from_handle(const c10::IValue& v) {
  return reinterpret_cast<T*>(static_cast<std::intptr_t>(v.toInt()));
}

void remember(AutogradContext* ctx, const WeightGradKernel& kernel, const at::Tensor& weight, bool trainable) {
  ctx->saved_data["store"] = to_handle(autograd::current_store());
  ctx->saved_data["mb"] = autograd::current_micro_batch();
  ctx->saved_data["kernel"] = to_handle(&kernel);
  // Frozen layers (no parameter requires grad) queue no weight work: autograd would leave their .grad undefined.
  ctx->saved_data["trainable"] = trainable;
  // The weight is read again in backward (input gradient). If an optimizer step modified it in between, the
  // input gradient would silently use the new weights: record the version to turn that into an error.
  ctx->saved_data["weight_version"] = static_cast<std::int64_t>(weight._version());
}

void check_weight_unchanged(AutogradContext* ctx, const at::Tensor& weight, const char* layer) {
  const auto saved = ctx->saved_data["weight_version"].toInt();
  TWOBP_CHECK(static_cast<std::int64_t>(weight._version()) == saved, UsageError,
              "{} weight was modified in place between forward and backward of micro-batch {} (version {} -> {}); "
              "run the optimizer step only after every backward of the step",
              layer, ctx->saved_data["mb"].toInt(), saved, weight._version());
}

// Queues the layer's weight work, once per forward: a layer whose input depends on parameters only (a learned
// query) sits on the general split's frontier and its backward runs again in W for the weight side; that second
// run must not queue the work a second time.
void hand_over(AutogradContext* ctx, at::Tensor input, at::Tensor grad_output, at::Tensor aux = {}) {
  if (!ctx->saved_data["trainable"].toBool() || ctx->saved_data.count("queued") != 0) return;
  ctx->saved_data["queued"] = true;
  auto* store = from_handle<WeightGradStore>(ctx->saved_data["store"]);
  auto* kernel = from_handle<const WeightGradKernel>(ctx->saved_data["kernel"]);
  store->on_backward(ctx->saved_data["mb"].toInt(), kernel,
                     {std::move(input), std::move(grad_output), std::move(aux)});
}

bool trainable(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

// Called when a fast-path node is recorded: rejects, on the first forward, parameters with gradient hooks.
void check_recordable(const WeightGradStore& store, const WeightGradKernel& kernel, const at::Tensor& weight,
                      const at::Tensor& bias) {
  const std::string context = fmt::format("{} micro-batch {}", store.context(), autograd::current_micro_batch());
  autograd::check_no_gradient_hooks(weight, kernel.kernel_name(), context);
  autograd::check_no_gradient_hooks(bias, kernel.kernel_name(), context);
}

// Parameters travel as a non-tensor argument: they must not become autograd inputs of the node (their gradient
// arrives through the store), and an undefined bias could not be an autograd input anyway.
struct Params {
  at::Tensor weight;
  at::Tensor bias;
  bool trainable = true;  ///< some parameter requires grad when the node is recorded
};

Params detached(const at::Tensor& weight, const at::Tensor& bias) {
  return {weight.detach(), bias.defined() ? bias.detach() : bias, trainable(weight) || trainable(bias)};
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& anchor,
                            const Params& params, const WeightGradKernel* kernel) {
    const at::Tensor& weight = params.weight;
    remember(ctx, *kernel, weight, params.trainable);
    ctx->save_for_backward({input});
    ctx->saved_data["weight"] = weight;
    return at::linear(input, weight, params.bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    const at::Tensor weight = ctx->saved_data["weight"].toTensor();
    check_weight_unchanged(ctx, weight, "Linear");
    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grads[0], weight);
    hand_over(ctx, input, grads[0]);
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct EmbeddingFunction : torch::autograd::Function<EmbeddingFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& ids, const at::Tensor& anchor,
                            const Params& params, const WeightGradKernel* kernel) {
    const at::Tensor& weight = params.weight;
    remember(ctx, *kernel, weight, params.trainable);
    ctx->saved_data["ids"] = ids;
    return at::embedding(weight, ids);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    hand_over(ctx, ctx->saved_data["ids"].toTensor(), grads[0]);
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Normalises in at least float32: reduced-precision sums of squares lose the small components.
at::ScalarType compute_type(const at::Tensor& t) {
  return at::isReducedFloatingType(t.scalar_type()) ? at::kFloat : t.scalar_type();
}

// t in `type`, without an operator call when it already is (Tensor::to would still be one).
at::Tensor as_type(const at::Tensor& t, at::ScalarType type) { return t.scalar_type() == type ? t : t.to(type); }

// The composite RMSNorm forward: x̂ = x / rms(x) in the input's dtype, and 1/rms in the compute type.
std::pair<at::Tensor, at::Tensor> normalize(const at::Tensor& input, double eps) {
  const at::Tensor x = as_type(input, compute_type(input));
  const at::Tensor rstd = at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {as_type(x * rstd, input.scalar_type()), rstd};
}

// RMSNorm on CUDA with `fused`: LibTorch's fused kernels, whose backward takes an output mask -- exactly the input
// gradient in I, exactly the weight gradient in W (rms_norm_weight_grad). Elsewhere the composite ops above.
struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& anchor,
                            const Params& params, double eps, bool fused, const WeightGradKernel* kernel) {
    const at::Tensor& weight = params.weight;
    remember(ctx, *kernel, weight, params.trainable);
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["fused"] = fused;
    if (fused) {
      auto [out, rstd] = at::_fused_rms_norm(input, {input.size(-1)}, weight, eps);
      ctx->save_for_backward({input, rstd});
      return out;
    }
    auto [normalized, rstd] = normalize(input, eps);
    ctx->save_for_backward({normalized, rstd});
    return normalized * weight;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor weight = ctx->saved_data["weight"].toTensor();
    check_weight_unchanged(ctx, weight, "RMSNorm");
    at::Tensor grad_input;
    if (ctx->saved_data["fused"].toBool()) {
      const at::Tensor& input = saved[0];
      const at::Tensor& rstd = saved[1];
      if (ctx->needs_input_grad(0)) {
        grad_input = std::get<0>(
            at::_fused_rms_norm_backward(grads[0], input, {input.size(-1)}, rstd, weight, {true, false}));
      }
      hand_over(ctx, input, grads[0], rstd);
      return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor& normalized = saved[0];
    const at::Tensor& rstd = saved[1];
    if (ctx->needs_input_grad(0)) {
      // d/dx [x * r] with r = (mean(x^2) + eps)^-1/2:  r * (g - x̂ * mean(g * x̂)), where g = grad_out * weight.
      const auto type = compute_type(normalized);
      const at::Tensor g = as_type(grads[0] * weight, type);
      const at::Tensor xh = as_type(normalized, type);
      grad_input = as_type(rstd * (g - xh * (g * xh).mean(-1, /*keepdim=*/true)), normalized.scalar_type());
    }
    hand_over(ctx, normalized, grads[0]);
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Rotary embedding as x ⊙ C + roll(x) ⊙ S: rolling the last dimension by half of it swaps the halves, and S
// carries the signs ([−s, s]). Rolling by half is its own inverse, so the transposed rotation is
// g ⊙ C + roll(g ⊙ S).
struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin_signed) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin_signed;
    return at::addcmul(x * cos, x.roll(x.size(-1) / 2, -1), sin_signed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& g = grads[0];
    const at::Tensor cos = ctx->saved_data["cos"].toTensor(), sin_signed = ctx->saved_data["sin"].toTensor();
    return {at::addcmul((g * sin_signed).roll(g.size(-1) / 2, -1), g, cos), at::Tensor(), at::Tensor()};
  }
};

// Flattens every item to [rows, cols] and concatenates them: the batched weight gradient of the 2BP paper.
std::pair<at::Tensor, at::Tensor> concat_rows(c10::ArrayRef<autograd::WeightGradItem> items, int64_t in_cols,
                                             int64_t out_cols) {
  if (items.size() == 1) {
    return {items[0].input.reshape({-1, in_cols}), items[0].grad_output.reshape({-1, out_cols})};
  }
  std::vector<at::Tensor> inputs, grads;
  inputs.reserve(items.size());
  grads.reserve(items.size());
  for (const auto& item : items) {
    inputs.push_back(item.input.reshape({-1, in_cols}));
    grads.push_back(item.grad_output.reshape({-1, out_cols}));
  }
  return {at::cat(inputs), at::cat(grads)};
}

// Whether a fast-path call has anything to differentiate. When not (a frozen layer on data: a frozen encoder or
// embedding on the first stage), it runs the plain ATen path: its output then carries no gradient, as autograd's
// would, instead of one tied to the store's anchor that nothing needs.
bool differentiable(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                  const autograd::WeightGradKernel& kernel) {
  auto* store = autograd::current_store();
  if (store == nullptr || !at::GradMode::is_enabled() || !differentiable({&input, &weight, &bias})) {
    return at::linear(input, weight, bias);
  }
  check_recordable(*store, kernel, weight, bias);
  return LinearFunction::apply(input, store->anchor(), detached(weight, bias), &kernel);
}

at::Tensor embedding(const at::Tensor& ids, const at::Tensor& weight, const autograd::WeightGradKernel& kernel) {
  auto* store = autograd::current_store();
  if (store == nullptr || !at::GradMode::is_enabled() || !differentiable({&weight})) {
    return at::embedding(weight, ids);
  }
  check_recordable(*store, kernel, weight, {});
  return EmbeddingFunction::apply(ids, store->anchor(), detached(weight, {}), &kernel);
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps,
                    const autograd::WeightGradKernel& kernel, bool fused_on_cuda) {
  auto* store = autograd::current_store();
  if (store == nullptr || !at::GradMode::is_enabled() || !differentiable({&input, &weight})) {
    return normalize(input, eps).first * weight;
  }
  check_recordable(*store, kernel, weight, {});
  const bool fused = fused_on_cuda && input.is_cuda();
  return RMSNormFunction::apply(input, store->anchor(), detached(weight, {}), eps, fused, &kernel);
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  return RotaryFunction::apply(x, cos, sin_signed);
}

// Whether W over several items should concatenate them into one GEMM. On GPUs a GEMM with few rows leaves most of
// the chip idle, so concatenating micro-batches (the 2BP paper's batched backward-p2) pays for its copies. On CPUs
// each micro-batch's GEMM already runs at full speed and the concatenation copies cost more than they save
// (measured with twobp_bench split --batched-w: 14% slower for 4 x 512 rows), so the items are accumulated one
// GEMM at a time straight into .grad, with no copy.
bool concatenate_items(c10::ArrayRef<autograd::WeightGradItem> items, int64_t cols, Batching batching) {
  constexpr int64_t kSmallRows = 4096;
  if (items.size() < 2 || batching == Batching::kSeparate) return false;
  if (batching == Batching::kConcatenate) return true;
  if (!items[0].input.is_cuda()) return false;
  return items[0].input.numel() / std::max<int64_t>(cols, 1) < kSmallRows;
}

void linear_weight_grad(const at::Tensor& weight, const at::Tensor& bias,
                        c10::ArrayRef<autograd::WeightGradItem> items, Batching batching) {
  // A frozen parameter keeps an undefined .grad, as autograd leaves it; its GEMM is skipped.
  const bool weight_grad = trainable(weight), bias_grad = trainable(bias);
  if (items.empty() || !(weight_grad || bias_grad)) return;
  const int64_t in = weight.size(1), out = weight.size(0);
  if (items.size() == 1 || concatenate_items(items, in, batching)) {
    auto [x, g] = concat_rows(items, in, out);
    if (weight_grad) autograd::accumulate_matmul(weight, g.t(), x);
    if (bias_grad) autograd::accumulate_grad(bias, g.sum(0));
    return;
  }
  for (const auto& item : items) linear_weight_grad(weight, bias, {item});
}

void embedding_weight_grad(const at::Tensor& weight, c10::ArrayRef<autograd::WeightGradItem> items) {
  if (items.empty() || !trainable(weight)) return;
  std::vector<at::Tensor> ids, grads;
  for (const auto& item : items) {
    ids.push_back(item.input.reshape({-1}));
    grads.push_back(item.grad_output.reshape({-1, weight.size(1)}));
  }
  const at::Tensor all_ids = items.size() == 1 ? ids[0] : at::cat(ids);
  const at::Tensor all_grads = items.size() == 1 ? grads[0] : at::cat(grads);
  // index_add_ sums rows with repeated ids (an index_put_ would keep only one of them). Like ATen's CUDA embedding
  // backward (its CPU kernel sums in the table's dtype), the sum is taken in float32 for reduced-precision tables,
  // so that a frequent token's gradient is not rounded to bf16 once per occurrence, then added to .grad once.
  // Under mixed precision the float32 sum goes straight into the master's .grad.
  const at::ScalarType type = compute_type(weight);
  const at::Tensor holder = autograd::gradient_holder(weight);
  at::Tensor& slot = const_cast<at::Tensor&>(holder).mutable_grad();
  if (type == holder.scalar_type() && slot.defined() && !slot.is_sparse()) {
    slot.index_add_(0, all_ids, as_type(all_grads, type));
    return;
  }
  at::Tensor sum = at::zeros(weight.sizes(), weight.options().dtype(type));
  sum.index_add_(0, all_ids, as_type(all_grads, type));
  autograd::accumulate_grad(weight, sum);
}

void rms_norm_weight_grad(const at::Tensor& weight, c10::ArrayRef<autograd::WeightGradItem> items) {
  if (items.empty() || !trainable(weight)) return;
  const int64_t dim = weight.size(0);
  auto [x, g] = concat_rows(items, dim, dim);
  if (items[0].aux.defined()) {
    // Fused (CUDA): the items hold the input and its 1/rms; the kernel computes exactly the weight gradient.
    at::Tensor rstd = items[0].aux.reshape({-1, 1});
    if (items.size() > 1) {
      std::vector<at::Tensor> rows;
      for (const auto& item : items) rows.push_back(item.aux.reshape({-1, 1}));
      rstd = at::cat(rows);
    }
    autograd::accumulate_grad(weight,
                              std::get<1>(at::_fused_rms_norm_backward(g, x, {dim}, rstd, weight, {false, true})));
    return;
  }
  // Composite: the items hold x̂. Reduce in float32 for reduced-precision activations, like the normalisation,
  // then round to the weight's dtype as autograd's gradient would be.
  const auto type = compute_type(x);
  autograd::accumulate_grad(weight, as_type((as_type(g, type) * as_type(x, type)).sum(0), weight.scalar_type()));
}

at::Tensor dropout(const at::Tensor& input, double p, bool training) {
  TWOBP_CHECK(p >= 0.0 && p <= 1.0, UsageError, "twobp::nn::functional::dropout: p must be in [0, 1], got {}", p);
  if (!training || p == 0.0) return input;
  if (p == 1.0) return input * 0;
  at::Tensor keep = at::empty_like(input);
  const at::Generator generator = stage_generator(input.device());
  if (generator.defined()) {
    keep.bernoulli_(1.0 - p, generator);
  } else {
    keep.bernoulli_(1.0 - p);
  }
  return input * keep.div_(1.0 - p);
}

}  // namespace twobp::nn::functional
