#pragma once
// The general path of the 2BP split: any LibTorch module, split by analysing its autograd graph.
//
// Let A be the nodes from which a stage input (or the fast-path anchor) is reachable, and P the nodes from
// which a leaf's AccumulateGrad is reachable (the trainable leaves are found in the graph itself, so a tensor
// listed twice by Module::parameters(), or a trainable leaf the module never registered, is handled exactly as
// loss.backward() handles it: once, by identity). Stage 1 runs the engine with only the A-targets as outputs;
// autograd then skips every edge outside A (generated backward formulas ask task_should_compute_output), so e.g.
// a convolution computes its input gradient but not its weight gradient. The "frontier" F are A-nodes with an
// edge into P \ A (the weight-bearing intermediate results); a pre-hook captures the gradient flowing into each
// of them. Stage 2 cuts the frontier nodes' edges back into A and runs the engine again from the frontier with
// the captured gradients and the leaves as outputs, so only the weight-side work is done: neither stage repeats
// the other's work. Nodes in A \ F release their saved tensors right after stage 1.
//
// Hooks: tensor hooks and retain_grad() on a frontier node's outputs run once, in stage 1 (the captured gradient
// is the hooked one; stage 2 runs with them removed and puts them back afterwards). Leaf (parameter) hooks run
// in stage 2 when autograd captures the leaf's gradient; post-accumulate-grad hooks fire after W accumulated the
// micro-batch's gradient, as AccumulateGrad fires them in loss.backward(). Node post-hooks on frontier nodes
// would see two partial results and are rejected. An in-place write into a view with a parameter operand puts a
// CopySlices node on the frontier; its wrapped function's edges are cut together with its own.
//
// Several outputs (a stage returning several differentiable tensors) are several roots of one engine run: roots
// that reach A run in stage 1 together, roots that reach only P are handed to stage 2 whole, with their seeds.
//
// Fast-only stages skip all of this: when every registered parameter of the stage is a fast-path layer's and no
// live graph uses one through ordinary ops (InputBackwardRequest::fast_path_parameters), stage 2 has no
// general-path work, and stage 1 is the one engine run B makes, minus the weight GEMMs the layers defer.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace twobp::detail {

/// Hooks moved off a frontier node after stage 1 (they already ran); given back when destroyed.
class StashedHooks {
 public:
  explicit StashedHooks(std::shared_ptr<torch::autograd::Node> node);
  StashedHooks(StashedHooks&& other) noexcept = default;
  StashedHooks& operator=(StashedHooks&&) = delete;
  StashedHooks(const StashedHooks&) = delete;
  StashedHooks& operator=(const StashedHooks&) = delete;
  ~StashedHooks();

 private:
  std::shared_ptr<torch::autograd::Node> node_;
  std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> tensor_pre_hooks_;
  std::unordered_map<std::size_t, std::unique_ptr<torch::autograd::FunctionPreHook>> retains_grad_hooks_;
  std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> pre_hooks_;
};

/// Stage-2 work of one micro-batch: engine roots with their captured gradients, and the leaves to collect.
struct SplitPlan {
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> root_grads;
  torch::autograd::edge_list leaf_edges;
  std::vector<at::Tensor> leaves;
  std::vector<StashedHooks> stashed_hooks;
};

struct InputBackwardRequest {
  std::vector<at::Tensor> outputs;       ///< what the backward starts from: the outputs that got a gradient
  std::vector<at::Tensor> grad_outputs;  ///< their gradients (defined), one per output
  std::vector<at::Tensor> inputs;        ///< stage input leaves (requiring grad) whose gradients are returned
  at::Tensor anchor;                     ///< the WeightGradStore anchor (reached by every fast-path layer)
  std::string context;                   ///< "rank R stage S micro-batch M", prefixed to every error
  /// Set when every parameter the stage registers belongs to a fast-path layer (the Stage decides once): then,
  /// unless a live graph uses one of these through ordinary ops, stage 1 runs without analysing the graph. A
  /// trainable leaf the module does not register then gets its (exact) gradient in stage 1.
  const std::vector<at::Tensor>* fast_path_parameters = nullptr;
};

struct InputBackwardResult {
  /// One per request input: its gradient, or undefined when no output depends on it (as .grad after
  /// loss.backward() would stay undefined).
  std::vector<at::Tensor> grad_inputs;
  std::unique_ptr<SplitPlan> plan;  ///< null when stage 2 has no general-path work
};

/// Stage 1. Fast-path layers reached by the graph queue their weight work in their store as a side effect.
/// Throws UsageError (before running anything) for graphs the split cannot run exactly; see the file comment.
InputBackwardResult run_input_backward(const InputBackwardRequest& request);

/// Stage 2 of the general path: accumulates the leaves' gradients into .grad, fires their post-accumulate-grad
/// hooks and releases the plan's graph.
void run_weight_backward(SplitPlan& plan);

}  // namespace twobp::detail
