#include "autograd/graph_split.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "twobp/autograd/weight_grad_store.h"

namespace twobp::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

constexpr std::uint8_t kVisited = 1;
constexpr std::uint8_t kReachesInput = 2;   // in A
constexpr std::uint8_t kReachesParam = 4;   // in P

struct GraphInfo {
  std::unordered_map<Node*, std::uint8_t> flags;
  std::vector<Node*> nodes;  // post-order
  // Strong references for as long as the analysis is used: cutting a frontier edge can drop the last reference
  // to an input-side node (e.g. the view in front of a biased Linear on 3-D input) while raw pointers to it are
  // still about to be visited.
  std::vector<std::shared_ptr<Node>> alive;
};

// Post-order walk from the root computing, for every node, whether it reaches an A-target and a parameter.
// Iterative: a 32-layer transformer chunk has graphs deep enough to overflow a recursive walk's stack.
GraphInfo analyse(Node* root, Node* input_target, Node* anchor_target,
                  const std::unordered_map<Node*, std::size_t>& param_nodes) {
  GraphInfo info;
  std::vector<std::pair<Node*, std::size_t>> stack;
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
    if (node == input_target || node == anchor_target) f |= kReachesInput;
    if (param_nodes.count(node) != 0) f |= kReachesParam;
    for (const Edge& e : node->next_edges()) {
      if (!e.is_valid()) continue;
      f |= info.flags[e.function.get()] & (kReachesInput | kReachesParam);
    }
    info.flags[node] = f;
    info.nodes.push_back(node);
    info.alive.push_back(node->shared_from_this());
    stack.pop_back();
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

}  // namespace

InputBackwardResult run_input_backward(const InputBackwardRequest& request) {
  namespace impl = torch::autograd::impl;
  InputBackwardResult result;
  const Edge root = impl::gradient_edge(request.output);
  TORCH_INTERNAL_ASSERT(root.is_valid(), "run_input_backward: output has no autograd history");

  const bool input_grad = request.input.defined() && request.input.requires_grad();
  std::shared_ptr<Node> input_acc = input_grad ? impl::try_get_grad_accumulator(request.input) : nullptr;
  std::shared_ptr<Node> anchor_acc = impl::try_get_grad_accumulator(request.anchor);
  std::unordered_map<Node*, std::size_t> param_nodes;
  std::vector<std::shared_ptr<Node>> param_accs(request.params.size());
  for (std::size_t i = 0; i < request.params.size(); ++i) {
    if (!request.params[i].requires_grad()) continue;
    // try_get: never create an accumulator for a parameter this graph does not use (fast-path parameters
    // are not autograd inputs at all).
    param_accs[i] = impl::try_get_grad_accumulator(request.params[i]);
    if (param_accs[i]) param_nodes.emplace(param_accs[i].get(), i);
  }

  const GraphInfo info = analyse(root.function.get(), input_acc.get(), anchor_acc.get(), param_nodes);
  auto flag = [&](Node* n) {
    auto it = info.flags.find(n);
    return it == info.flags.end() ? std::uint8_t{0} : it->second;
  };

  std::vector<Node*> frontier;
  for (Node* n : info.nodes) {
    if (!(flag(n) & kReachesInput)) continue;
    for (const Edge& e : n->next_edges()) {
      if (e.is_valid() && weight_side(info, e.function.get())) {
        frontier.push_back(n);
        break;
      }
    }
  }

  auto plan = std::make_unique<SplitPlan>();
  const bool root_in_a = flag(root.function.get()) & kReachesInput;
  if (root_in_a) {
    auto captures = std::make_shared<Captures>();
    std::vector<std::pair<Node*, const torch::autograd::FunctionPreHook*>> hooks;
    for (Node* n : frontier) {
      auto hook = std::make_unique<CaptureHook>(captures, n);
      hooks.emplace_back(n, hook.get());
      n->add_pre_hook(std::move(hook));
    }
    edge_list outputs;
    if (input_grad && input_acc && (flag(input_acc.get()) & kVisited)) outputs.emplace_back(input_acc, 0);
    const bool has_input_output = !outputs.empty();
    if (anchor_acc && (flag(anchor_acc.get()) & kVisited)) outputs.emplace_back(anchor_acc, 0);
    // keep_graph only when stage 2 must re-enter frontier nodes; a pure fast-path graph is freed right here.
    const bool keep_graph = !frontier.empty();
    variable_list grads = torch::autograd::Engine::get_default_engine().execute(
        {root}, {request.grad_output}, keep_graph, /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
    for (auto& [node, hook] : hooks) remove_hook(node, hook);
    if (has_input_output) result.grad_input = grads[0];

    for (Node* n : frontier) {
      auto it = captures->grads.find(n);
      if (it == captures->grads.end()) continue;  // received no gradient: contributes nothing to W
      for (std::size_t i = 0; i < it->second.size(); ++i) {
        if (!it->second[i].defined()) continue;
        plan->roots.emplace_back(n->shared_from_this(), static_cast<uint32_t>(i));
        plan->root_grads.push_back(it->second[i]);
      }
    }
    if (keep_graph) {
      std::unordered_map<Node*, bool> is_frontier;
      for (Node* n : frontier) is_frontier[n] = true;
      for (Node* n : info.nodes) {
        if ((flag(n) & kReachesInput) && !is_frontier.count(n)) n->release_variables();
      }
    }
    // Cut every frontier edge that does not lead to weight-side nodes: stage 2 must not redo input gradients.
    for (Node* n : frontier) {
      for (std::size_t i = 0; i < n->num_outputs(); ++i) {
        const Edge& e = n->next_edge(i);
        // Assign through next_edges() rather than set_next_edge(): removing an edge keeps the node's
        // topological number valid (it only has to exceed its children's), while set_next_edge would assert.
        if (e.is_valid() && !weight_side(info, e.function.get())) n->next_edges()[i] = Edge();
      }
    }
  } else if (flag(root.function.get()) & kReachesParam) {
    // Nothing upstream needs a gradient (e.g. a first stage of general modules): all work is stage 2.
    plan->roots.push_back(root);
    plan->root_grads.push_back(request.grad_output);
  }

  if (input_grad && !result.grad_input.defined()) result.grad_input = at::zeros_like(request.input);

  if (!plan->roots.empty()) {
    for (std::size_t i = 0; i < param_accs.size(); ++i) {
      if (param_accs[i] && (flag(param_accs[i].get()) & kVisited)) {
        plan->param_edges.emplace_back(param_accs[i], 0);
        plan->params.push_back(request.params[i]);
      }
    }
    result.plan = std::move(plan);
  }
  return result;
}

void run_weight_backward(SplitPlan& plan) {
  if (plan.roots.empty() || plan.param_edges.empty()) return;
  variable_list grads = torch::autograd::Engine::get_default_engine().execute(
      plan.roots, plan.root_grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false,
      plan.param_edges);
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    // The engine's result may alias a tensor someone else holds (a captured root gradient passed through an
    // identity node); only a gradient nothing else references may become .grad without a copy. Same test as
    // autograd's own AccumulateGrad, extended to the transposed views matrix products return.
    const bool fresh = g.use_count() == 1 &&
                       (g.is_view() ? g._base().use_count() == 1 && g.storage().use_count() == 2
                                    : g.storage().use_count() == 1);
    autograd::accumulate_grad(plan.params[i], g, fresh);
  }
  plan = SplitPlan{};
}

}  // namespace twobp::detail
