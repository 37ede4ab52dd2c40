#include "autograd/graph_split.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "twobp/autograd/weight_grad_store.h"
#include "util/check.h"

namespace twobp::detail {
namespace {

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

constexpr std::uint8_t kVisited = 1;
constexpr std::uint8_t kReachesInput = 2;   // in A
constexpr std::uint8_t kReachesParam = 4;   // in P

struct GraphInfo {
  std::unordered_map<Node*, std::uint8_t> flags;
  std::vector<Node*> nodes;    // post-order
  std::vector<Node*> leaves;   // AccumulateGrad nodes of trainable leaves (not the input, not the anchor)
  // Strong references for as long as the analysis is used: cutting a frontier edge can drop the last reference
  // to an input-side node (e.g. the view in front of a biased Linear on 3-D input) while raw pointers to it are
  // still about to be visited.
  std::vector<std::shared_ptr<Node>> alive;
};

// Post-order walk from the roots computing, for every node, whether it reaches an A-target and a trainable leaf.
// Iterative: a 32-layer transformer chunk has graphs deep enough to overflow a recursive walk's stack.
GraphInfo analyse(const std::vector<Node*>& roots, const std::unordered_set<Node*>& a_targets) {
  GraphInfo info;
  std::vector<std::pair<Node*, std::size_t>> stack;
  for (Node* root : roots) {
    if (info.flags.count(root)) continue;
    stack.emplace_back(root, 0);
    info.flags[root] = kVisited;
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->num_outputs()) {
        Node* child = node->next_edge(next++).function.get();
        if (child != nullptr && info.flags.find(child) == info.flags.end()) {
          info.flags[child] = kVisited;
          stack.emplace_back(child, 0);
        }
        continue;
      }
      std::uint8_t f = kVisited;
      if (a_targets.count(node)) {
        f |= kReachesInput;
      } else if (dynamic_cast<AccumulateGrad*>(node) != nullptr) {
        // Every trainable leaf the graph reaches, registered under the module or not, listed once however many
        // names it has: exactly the set loss.backward() accumulates into.
        f |= kReachesParam;
        info.leaves.push_back(node);
      }
      for (const Edge& e : node->next_edges()) {
        if (!e.is_valid()) continue;
        f |= info.flags[e.function.get()] & (kReachesInput | kReachesParam);
      }
      info.flags[node] = f;
      info.nodes.push_back(node);
      info.alive.push_back(node->shared_from_this());
      stack.pop_back();
    }
  }
  return info;
}

bool weight_side(const GraphInfo& info, Node* node) {
  auto it = info.flags.find(node);
  return it != info.flags.end() && (it->second & kReachesParam) && !(it->second & kReachesInput);
}

// Captures the gradient flowing into a frontier node during stage 1 (the node's inputs = grads of its outputs).
struct Captures {
  std::mutex mutex;  // CUDA graphs run nodes on autograd's device threads
  std::unordered_map<Node*, variable_list> grads;
};

class CaptureHook : public torch::autograd::FunctionPreHook {
 public:
  CaptureHook(std::shared_ptr<Captures> sink, Node* node) : sink_(std::move(sink)), node_(node) {}
  variable_list operator()(const variable_list& grads) override {
    std::lock_guard<std::mutex> lock(sink_->mutex);
    sink_->grads[node_] = grads;
    return grads;
  }

 private:
  std::shared_ptr<Captures> sink_;
  Node* node_;
};

void remove_hook(Node* node, const torch::autograd::FunctionPreHook* hook) {
  auto& hooks = node->pre_hooks();
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == hook; }),
              hooks.end());
}

// Frontier nodes run twice (input side in stage 1, weight side in stage 2). Reject, before any work is done, the
// nodes for which that is not exact: a node post-hook would see two partial results.
void check_frontier(const std::vector<Node*>& frontier, const std::string& context) {
  for (Node* n : frontier) {
    TWOBP_CHECK(n->post_hooks().empty(), UsageError,
                "{}: autograd node {} has a post-hook (Node::register_hook); 2BP runs this weight-bearing node "
                "twice (input side in I, weight side in W) so the hook would see two partial results; remove the "
                "hook or run this stage with BackwardMode::kStandard",
                context, n->name());
  }
}

}  // namespace

StashedHooks::StashedHooks(std::shared_ptr<Node> node) : node_(std::move(node)) {
  tensor_pre_hooks_ = std::move(node_->tensor_pre_hooks());
  node_->tensor_pre_hooks().clear();
  retains_grad_hooks_ = std::move(node_->retains_grad_hooks());
  node_->retains_grad_hooks().clear();
  pre_hooks_ = std::move(node_->pre_hooks());
  node_->pre_hooks().clear();
}

StashedHooks::~StashedHooks() {
  if (!node_) return;  // moved from
  for (auto& h : tensor_pre_hooks_) node_->tensor_pre_hooks().push_back(std::move(h));
  for (auto& [index, h] : retains_grad_hooks_) node_->retains_grad_hooks()[index] = std::move(h);
  for (auto& h : pre_hooks_) node_->pre_hooks().push_back(std::move(h));
}

namespace {

namespace impl = torch::autograd::impl;

// Whether the graph can reach a registered parameter through ordinary ops: LibTorch keeps a parameter's gradient
// accumulator alive exactly while some live graph uses it (by a weak reference), so one that is gone means no
// graph -- this micro-batch's included -- has an edge to it.
bool reaches_registered_parameter(const std::vector<at::Tensor>& parameters) {
  for (const at::Tensor& p : parameters) {
    if (p.defined() && p.requires_grad() && impl::try_get_grad_accumulator(p) != nullptr) return true;
  }
  return false;
}

// The fast-only stage 1: every registered parameter is a fast-path layer's and no graph uses one through ordinary
// ops, so stage 2 has no general-path work. One engine run, as B runs it (accumulating into the leaves: the stage
// inputs, and any trainable leaf the module does not register, which then gets its gradient here, exactly),
// without analysing the graph; the fast-path layers queue their weight work as a side effect.
InputBackwardResult run_fast_only(const InputBackwardRequest& request, const edge_list& roots) {
  InputBackwardResult result;
  torch::autograd::Engine::get_default_engine().execute(roots, request.grad_outputs, /*keep_graph=*/false,
                                                        /*create_graph=*/false, /*accumulate_grad=*/true, {});
  for (const at::Tensor& in : request.inputs) {
    if (!in.defined() || !in.requires_grad()) {
      result.grad_inputs.emplace_back();
      continue;
    }
    at::Tensor& g = const_cast<at::Tensor&>(in).mutable_grad();
    result.grad_inputs.push_back(std::move(g));
    g.reset();
  }
  return result;
}

// The gradient accumulators stage 1 asks the engine for: the inputs' (null where an input needs no gradient) and
// the anchor's, and the set of them (the A-targets of the analysis).
struct Targets {
  std::vector<std::shared_ptr<Node>> inputs;
  std::shared_ptr<Node> anchor;
  std::unordered_set<Node*> all;
};

Targets find_targets(const InputBackwardRequest& request) {
  Targets t;
  for (const at::Tensor& in : request.inputs) {
    t.inputs.push_back(in.defined() && in.requires_grad() ? impl::try_get_grad_accumulator(in) : nullptr);
    if (t.inputs.back()) t.all.insert(t.inputs.back().get());
  }
  t.anchor = impl::try_get_grad_accumulator(request.anchor);
  if (t.anchor) t.all.insert(t.anchor.get());
  return t;
}

std::uint8_t flag_of(const GraphInfo& info, Node* n) {
  auto it = info.flags.find(n);
  return it == info.flags.end() ? std::uint8_t{0} : it->second;
}

// Nodes of A with an edge into P \ A: the weight-bearing intermediates whose incoming gradient stage 2 needs.
std::vector<Node*> find_frontier(const GraphInfo& info) {
  std::vector<Node*> frontier;
  for (Node* n : info.nodes) {
    if (!(flag_of(info, n) & kReachesInput)) continue;
    for (const Edge& e : n->next_edges()) {
      if (e.is_valid() && weight_side(info, e.function.get())) {
        frontier.push_back(n);
        break;
      }
    }
  }
  return frontier;
}

// Runs the engine from the A-roots with the targets as outputs, capturing the gradient flowing into each frontier
// node; fills the input gradients and hands the captured gradients to the plan as stage-2 roots.
void run_stage1(const GraphInfo& info, const Targets& targets, const std::vector<Node*>& frontier,
                const edge_list& a_roots, const variable_list& a_seeds, InputBackwardResult& result,
                SplitPlan& plan) {
  auto captures = std::make_shared<Captures>();
  std::vector<std::pair<Node*, const torch::autograd::FunctionPreHook*>> hooks;
  for (Node* n : frontier) {
    auto hook = std::make_unique<CaptureHook>(captures, n);
    hooks.emplace_back(n, hook.get());
    n->add_pre_hook(std::move(hook));
  }
  edge_list outputs;
  std::vector<std::size_t> output_of_input;  // engine output index -> request input index
  for (std::size_t i = 0; i < targets.inputs.size(); ++i) {
    if (targets.inputs[i] && (flag_of(info, targets.inputs[i].get()) & kVisited)) {
      outputs.emplace_back(targets.inputs[i], 0);
      output_of_input.push_back(i);
    }
  }
  if (targets.anchor && (flag_of(info, targets.anchor.get()) & kVisited)) outputs.emplace_back(targets.anchor, 0);
  // keep_graph only when stage 2 must re-enter frontier nodes; a pure fast-path graph is freed right here.
  variable_list grads;
  try {
    grads = torch::autograd::Engine::get_default_engine().execute(
        a_roots, a_seeds, /*keep_graph=*/!frontier.empty(), /*create_graph=*/false, /*accumulate_grad=*/false,
        outputs);
  } catch (...) {
    for (auto& [node, hook] : hooks) remove_hook(node, hook);
    throw;
  }
  for (auto& [node, hook] : hooks) remove_hook(node, hook);
  for (std::size_t k = 0; k < output_of_input.size(); ++k) result.grad_inputs[output_of_input[k]] = grads[k];
  for (Node* n : frontier) {
    auto it = captures->grads.find(n);
    if (it == captures->grads.end()) continue;  // received no gradient: contributes nothing to W
    for (std::size_t i = 0; i < it->second.size(); ++i) {
      if (!it->second[i].defined()) continue;
      plan.roots.emplace_back(n->shared_from_this(), static_cast<uint32_t>(i));
      plan.root_grads.push_back(it->second[i]);
    }
  }
}

// After stage 1: frees what stage 2 does not need, stashes the frontier's hooks (they ran) and cuts every frontier
// edge that does not lead to weight-side nodes, so that stage 2 does not redo input gradients.
void prepare_stage2(const GraphInfo& info, const std::vector<Node*>& frontier, SplitPlan& plan) {
  std::unordered_set<Node*> is_frontier(frontier.begin(), frontier.end());
  for (Node* n : info.nodes) {
    if ((flag_of(info, n) & kReachesInput) && !is_frontier.count(n)) n->release_variables();
  }
  for (Node* n : frontier) plan.stashed_hooks.emplace_back(n->shared_from_this());
  for (Node* n : frontier) {
    for (std::size_t i = 0; i < n->num_outputs(); ++i) {
      const Edge& e = n->next_edge(i);
      // Assign through next_edges() rather than set_next_edge(): removing an edge keeps the node's
      // topological number valid (it only has to exceed its children's), while set_next_edge would assert.
      if (e.is_valid() && !weight_side(info, e.function.get())) {
        n->next_edges()[i] = Edge();
        // An in-place update of a view (h.narrow(...).mul_(scale)) is a CopySlices node whose wrapped function
        // has edges parallel to its own; both must be cut alike, or CopySlices refuses to run.
        if (auto* copy_slices = dynamic_cast<torch::autograd::CopySlices*>(n);
            copy_slices && copy_slices->fn && i < copy_slices->fn->num_outputs()) {
          copy_slices->fn->next_edges()[i] = Edge();
        }
      }
    }
  }
}

// The general stage 1 (see the file comment): analyse, split the roots, run, prepare stage 2.
InputBackwardResult run_general(const InputBackwardRequest& request, const edge_list& roots) {
  InputBackwardResult result;
  result.grad_inputs.resize(request.inputs.size());
  std::vector<Node*> root_nodes;
  for (const Edge& r : roots) root_nodes.push_back(r.function.get());
  const Targets targets = find_targets(request);
  const GraphInfo info = analyse(root_nodes, targets.all);
  const std::vector<Node*> frontier = find_frontier(info);
  check_frontier(frontier, request.context);

  // Roots reaching A run in stage 1; roots reaching only trainable leaves are all stage-2 work (e.g. a first
  // stage of general modules: nothing upstream needs a gradient).
  auto plan = std::make_unique<SplitPlan>();
  edge_list a_roots;
  variable_list a_seeds;
  for (std::size_t r = 0; r < roots.size(); ++r) {
    const std::uint8_t f = flag_of(info, roots[r].function.get());
    if (f & kReachesInput) {
      a_roots.push_back(roots[r]);
      a_seeds.push_back(request.grad_outputs[r]);
    } else if (f & kReachesParam) {
      plan->roots.push_back(roots[r]);
      plan->root_grads.push_back(request.grad_outputs[r]);
    }
  }
  if (!a_roots.empty()) {
    run_stage1(info, targets, frontier, a_roots, a_seeds, result, *plan);
    if (!frontier.empty()) prepare_stage2(info, frontier, *plan);
  }
  if (!plan->roots.empty()) {
    for (Node* leaf : info.leaves) {
      plan->leaf_edges.emplace_back(leaf->shared_from_this(), 0);
      plan->leaves.push_back(static_cast<AccumulateGrad*>(leaf)->variable);
    }
    result.plan = std::move(plan);
  }
  return result;
}

}  // namespace

InputBackwardResult run_input_backward(const InputBackwardRequest& request) {
  TORCH_INTERNAL_ASSERT(request.outputs.size() == request.grad_outputs.size(),
                        "run_input_backward: one gradient per output");
  edge_list roots;
  for (const at::Tensor& out : request.outputs) {
    roots.push_back(impl::gradient_edge(out));
    TORCH_INTERNAL_ASSERT(roots.back().is_valid(), "run_input_backward: an output has no autograd history");
  }
  if (request.fast_path_parameters != nullptr && !reaches_registered_parameter(*request.fast_path_parameters)) {
    return run_fast_only(request, roots);
  }
  return run_general(request, roots);
}

void run_weight_backward(SplitPlan& plan) {
  if (!plan.roots.empty() && !plan.leaf_edges.empty()) {
    variable_list grads = torch::autograd::Engine::get_default_engine().execute(
        plan.roots, plan.root_grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false,
        plan.leaf_edges);
    // Release the graph's buffers before accumulating (peak memory), keeping only what is accumulated.
    plan.roots.clear();
    plan.root_grads.clear();
    plan.leaf_edges.clear();
    for (std::size_t i = 0; i < grads.size(); ++i) {
      at::Tensor g = std::move(grads[i]);
      if (!g.defined()) continue;
      // The engine's result may alias a tensor someone else holds (a captured root gradient passed through an
      // identity node); only a gradient nothing else references may become .grad without a copy. Same test as
      // autograd's own AccumulateGrad, extended to the transposed views matrix products return.
      // Sparse gradients (an Embedding with sparse=true) have no storage to ask; they are copied.
      const bool fresh = g.layout() == at::kStrided && g.use_count() == 1 &&
                         (g.is_view() ? g._base().use_count() == 1 && g.storage().use_count() == 2
                                      : g.storage().use_count() == 1);
      autograd::accumulate_grad(plan.leaves[i], g, fresh);
      // As AccumulateGrad does after accumulating in loss.backward(): once per micro-batch and leaf.
      if (auto& hook = torch::autograd::impl::post_acc_grad_hooks(plan.leaves[i])) (*hook)(plan.leaves[i]);
    }
  }
  plan.roots.clear();
  plan.root_grads.clear();
  plan.leaf_edges.clear();
  plan.leaves.clear();
  plan.stashed_hooks.clear();
}

}  // namespace twobp::detail
