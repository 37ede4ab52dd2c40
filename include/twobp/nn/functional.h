#pragma once
// The 2BP fast-path operations as free functions. Inside a RecordingScope (i.e. inside Stage::forward) they
// build a custom autograd node whose backward computes only the input gradient and hands the weight-gradient
// work to the scope's WeightGradStore; outside a scope they are the ordinary ATen ops.
//
// Limitation (documented contract): inside a scope the parameters are not autograd inputs of the node, so
// torch::autograd::grad(loss, weight) cannot see them and double backward is not supported. Weight gradients
// arrive only through the store (backward_weight) or, under WeightGradPolicy::kImmediate, directly in .grad.

#include <ATen/core/Tensor.h>

#include "twobp/autograd/weight_grad_store.h"

namespace twobp::nn::functional {

/// y = x W^T + b. `bias` may be undefined. `kernel` computes dW = Σ g^T x and db = Σ g for the queued items.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                  const autograd::WeightGradKernel& kernel);

/// y = weight[ids]. Repeated ids accumulate in the weight gradient (index_add, never overwrite).
at::Tensor embedding(const at::Tensor& ids, const at::Tensor& weight, const autograd::WeightGradKernel& kernel);

/// y = x / sqrt(mean(x^2, -1) + eps) * weight, normalized in float32 for reduced-precision inputs. Inside a scope
/// on CUDA with `fused_on_cuda`: LibTorch's fused kernels (at::_fused_rms_norm; its backward with the output mask
/// of exactly the input gradient in I and exactly the weight gradient in W); elsewhere composite ops.
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps,
                    const autograd::WeightGradKernel& kernel, bool fused_on_cuda = true);

/// Rotary position embedding (rotate-half convention) as one autograd node: with x = [x1, x2] the halves of the
/// last dimension, [x1 c − x2 s, x2 c + x1 s] for c, s the cosines and sines of the angles. `cos` = [c, c] and
/// `sin_signed` = [−s, s] are tables broadcastable against x, in its dtype (nn::RotaryEmbedding makes them);
/// forward and backward are three operators each (x ⊙ cos + roll(x) ⊙ sin_signed, and its transpose). Not twice
/// differentiable.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed);

/// Dropout (training: each element zeroed with probability p, the rest scaled by 1 / (1 - p); otherwise the
/// input). The mask is drawn from the running stage's generator (twobp::stage_generator(), twobp/random.h): the
/// same masks whether ranks are threads or processes, under any schedule, and again when a forward is recomputed.
/// Outside a stage forward it draws from LibTorch's default generator, like torch::nn::functional::dropout.
at::Tensor dropout(const at::Tensor& input, double p, bool training);

/// How a weight-gradient kernel reduces several queued items (micro-batches).
enum class Batching {
  kAuto,         ///< concatenate on CUDA when each item is small (< 4096 rows), else one GEMM per item
  kConcatenate,  ///< always one GEMM over the concatenated items (the 2BP paper's batched backward-p2)
  kSeparate,     ///< one GEMM per item, accumulated into .grad without copies
};

// Weight-gradient kernels shared by the module classes (and usable by custom layers with the same shapes).
void linear_weight_grad(const at::Tensor& weight, const at::Tensor& bias, c10::ArrayRef<autograd::WeightGradItem> items,
                        Batching batching = Batching::kAuto);
void embedding_weight_grad(const at::Tensor& weight, c10::ArrayRef<autograd::WeightGradItem> items);
void rms_norm_weight_grad(const at::Tensor& weight, c10::ArrayRef<autograd::WeightGradItem> items);

}  // namespace twobp::nn::functional
