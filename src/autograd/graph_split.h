#pragma once
// The general path of the 2BP split: any LibTorch module, split by analysing its autograd graph.
//
// Let A be the nodes from which the stage input (or the fast-path anchor) is reachable, and P the nodes from
// which a parameter's AccumulateGrad is reachable. Stage 1 runs the engine with only the A-targets as outputs;
// autograd then skips every edge outside A (generated backward formulas ask task_should_compute_output), so
// e.g. a convolution computes its input gradient but not its weight gradient. The "frontier" F are A-nodes with
// an edge into P \ A (the weight-bearing intermediate results); a pre-hook captures the gradient flowing into
// each of them. Stage 2 cuts the frontier nodes' edges back into A and runs the engine again from the frontier
// with the captured gradients and the parameters as outputs, so only the weight-side work is done: neither
// stage repeats the other's work. Nodes in A \ F release their saved tensors right after stage 1.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <vector>

namespace twobp::detail {

/// Stage-2 work of one micro-batch: engine roots with their captured gradients, and the parameters to collect.
struct SplitPlan {
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> root_grads;
  torch::autograd::edge_list param_edges;
  std::vector<at::Tensor> params;
};

struct InputBackwardRequest {
  at::Tensor output;       ///< what the backward starts from
  at::Tensor grad_output;  ///< its gradient
  at::Tensor input;        ///< stage input leaf; its gradient is returned if it requires grad
  at::Tensor anchor;       ///< the WeightGradStore anchor (reached by every fast-path layer)
  std::vector<at::Tensor> params;
};

struct InputBackwardResult {
  at::Tensor grad_input;             ///< undefined when the input needs no gradient
  std::unique_ptr<SplitPlan> plan;   ///< null when stage 2 has no general-path work
};

/// Stage 1. Fast-path layers reached by the graph queue their weight work in their store as a side effect.
InputBackwardResult run_input_backward(const InputBackwardRequest& request);

/// Stage 2 of the general path: accumulates the parameter gradients into .grad and releases the plan's graph.
void run_weight_backward(SplitPlan& plan);

}  // namespace twobp::detail
