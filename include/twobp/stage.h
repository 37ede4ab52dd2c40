#pragma once
// A Stage is one pipeline chunk: a module plus the bookkeeping that lets its backward run either fused
// (ordinary backprop, action B) or split by 2BP into stage 1 (I: input gradient) and stage 2 (W: weight
// gradients, possibly for several micro-batches at once).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "twobp/autograd/weight_grad_store.h"

namespace torch::nn {
class Module;
}

namespace twobp {

namespace detail {
struct SplitPlan;
}

/// Computes a scalar loss from the last stage's output and the micro-batch target.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
/// The chunk's forward: input -> output. Usually wraps a module's forward().
using StageForward = std::function<at::Tensor(const at::Tensor& input)>;

struct StageOptions {
  int stage_index = 0;  ///< global stage index, used in error messages and to decide on input gradients
  int num_stages = 1;
  int rank = 0;  ///< owning rank, used in error messages
  /// Set on the last stage: forward() then returns loss(output, target) and backward starts from it.
  LossFunction loss;
  /// Gradient seeded into a scalar loss. The Pipeline sets it to 1/num_micro_batches so that the summed
  /// gradients of a step equal those of the mean loss over the whole batch.
  double loss_scale = 1.0;
  /// Stage 2 of several micro-batches hands all their queued work to each layer's kernel in one call, which may
  /// concatenate it into one GEMM (nn::functional::Batching::kAuto: on CUDA for small micro-batches).
  bool batch_weight_grads = true;
};

/// `tensors` without repeats, by tensor identity, in first-seen order. Module::parameters() lists a tensor once
/// per name it is registered under; optimizers, norms and clipping must see it once.
std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors);

/// One chunk of a pipeline.
///
/// Per micro-batch lifecycle (every call names the micro-batch; a violation throws UsageError naming stage and
/// micro-batch):
///   forward(mb) ──► backward(mb)                               ordinary backprop
///   forward(mb) ──► backward_input(mb) ──► backward_weight({mb, ...})   2BP
///
/// What is alive between the calls:
///  - after forward: the autograd graph of the micro-batch with all saved activations.
///  - after backward_input: fast-path layers keep only (input, grad_output) per layer (Linear: x and dY;
///    RMSNorm: x̂ and dY; Embedding: ids and dY); for other modules (general path) the weight-bearing nodes
///    of the graph that have an edge to a parameter keep their saved tensors and the gradient flowing into them
///    ("frontier" nodes), every other node's saved tensors are released.
///  - after backward_weight or backward: nothing; the micro-batch is forgotten and may be reused next step.
///
/// Parameter gradients are accumulated (summed) into .grad across micro-batches; zero them between steps.
/// A Stage is used by one thread at a time.
class Stage {
 public:
  Stage(std::shared_ptr<torch::nn::Module> module, StageForward forward, StageOptions options);
  ~Stage();
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  /// Runs the chunk on `input` (the previous stage's output, or the first stage's data). `target` is passed to
  /// the loss on the last stage. Returns the output (the loss on the last stage); the caller sends it on.
  at::Tensor forward(int micro_batch, const at::Tensor& input, const at::Tensor& target = {});

  /// 2BP stage 1: the gradient w.r.t. the stage input, to be sent upstream. `grad_output` must match the
  /// output's shape and dtype; on the last stage (scalar loss) it may be undefined and loss_scale is used.
  /// Returns an undefined tensor when the input needs no gradient (first stage).
  at::Tensor backward_input(int micro_batch, const at::Tensor& grad_output = {});

  /// 2BP stage 2 for micro-batches whose backward_input ran, in any order; accumulates into .grad.
  /// `done`, when given, is called during the W with parameters whose gradient no later part of this W writes
  /// (fast-path layers' parameters as each layer finishes; general-path leaves are not reported). The caller
  /// passes it on the stage's last W of a step, to start reducing those gradients while the W goes on.
  void backward_weight(const std::vector<int>& micro_batches, const autograd::ParametersDone& done = nullptr);

  /// Ordinary (fused) backprop for one micro-batch: returns the input gradient and accumulates into .grad.
  at::Tensor backward(int micro_batch, const at::Tensor& grad_output = {});

  /// Forgets every micro-batch of the current step (after an error), releasing its memory.
  void reset();

  const StageOptions& options() const { return options_; }
  torch::nn::Module& module() const { return *module_; }
  /// The module's parameters, each tensor once (a submodule registered under two names, or a tied weight, is
  /// listed once). Trainable leaves the forward uses without registering them still get gradients, as with
  /// loss.backward(), but are not listed here (nor clipped, checkpointed or optimized by what uses this list).
  std::vector<at::Tensor> parameters() const;
  /// Micro-batches with state held (forwarded and not yet fully backpropagated).
  std::size_t live_micro_batches() const { return micro_batches_.size(); }
  /// Micro-batches whose I ran and whose W has not: the deferred weight work this stage holds.
  std::size_t pending_weight_micro_batches() const;
  autograd::WeightGradStore& weight_grad_store() { return store_; }

 private:
  enum class Phase { kForwarded, kInputGradDone };
  struct MicroBatch {
    Phase phase = Phase::kForwarded;
    at::Tensor input;   // leaf the input gradient is taken against (undefined grad requirement on stage 0)
    at::Tensor output;  // the output (or loss) the backward starts from
    std::unique_ptr<detail::SplitPlan> plan;  // general-path stage-2 work, after backward_input
  };

  MicroBatch& lookup(int micro_batch, const char* action);
  at::Tensor seed_gradient(int micro_batch, const MicroBatch& state, const at::Tensor& grad_output) const;
  std::string where(int micro_batch) const;

  std::shared_ptr<torch::nn::Module> module_;
  StageForward forward_;
  StageOptions options_;
  autograd::WeightGradStore store_;
  std::map<int, MicroBatch> micro_batches_;
};

}  // namespace twobp
