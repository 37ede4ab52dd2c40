#include "twobp/stage.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>

#include <set>
#include <unordered_set>

#include "autograd/graph_split.h"
#include <fmt/ranges.h>

#include "util/check.h"
#include "util/format.h"

namespace twobp {

namespace {
std::string shape_of(const at::Tensor& t) {
  return t.defined() ? detail::describe_shape(t.sizes(), t.scalar_type())
                     : std::string("undefined");
}
}  // namespace

Stage::Stage(std::shared_ptr<torch::nn::Module> module, StageForward forward, StageOptions options)
    : module_(std::move(module)), forward_(std::move(forward)), options_(std::move(options)) {
  TWOBP_CHECK(module_ != nullptr, UsageError, "Stage {}: module is null", options_.stage_index);
  TWOBP_CHECK(static_cast<bool>(forward_), UsageError, "Stage {}: forward function is empty", options_.stage_index);
  store_.set_context(fmt::format("rank {} stage {}", options_.rank, options_.stage_index));
}

Stage::~Stage() {
  // Graphs reference the store and the module's kernels through raw handles: drop them first.
  micro_batches_.clear();
  store_.clear();
}

std::string Stage::where(int micro_batch) const {
  return fmt::format("rank {} stage {} micro-batch {}", options_.rank, options_.stage_index, micro_batch);
}

std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& t : tensors) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

std::vector<at::Tensor> Stage::parameters() const { return unique_tensors(module_->parameters()); }

std::size_t Stage::pending_weight_micro_batches() const {
  std::size_t n = 0;
  for (const auto& [mb, state] : micro_batches_) n += state.phase == Phase::kInputGradDone ? 1 : 0;
  return n;
}

at::Tensor Stage::forward(int micro_batch, const at::Tensor& input, const at::Tensor& target) {
  TWOBP_CHECK(micro_batches_.count(micro_batch) == 0, UsageError,
              "{}: F called again before the backward of its previous F ran", where(micro_batch));
  TWOBP_CHECK(input.defined(), UsageError, "{}: F got an undefined input tensor", where(micro_batch));
  MicroBatch state;
  // The first stage's input is data (token ids, images): no gradient is sent upstream from it.
  const bool input_grad = options_.stage_index > 0 && input.is_floating_point();
  state.input = input_grad ? input.detach().requires_grad_(true) : input;
  at::Tensor output;
  {
    c10::AutoGradMode grad_mode(true);
    autograd::RecordingScope scope(store_, micro_batch);
    output = forward_(state.input);
    if (options_.loss) {
      TWOBP_CHECK(target.defined(), UsageError, "{}: the last stage computes a loss and needs a target",
                  where(micro_batch));
      output = options_.loss(output, target);
      TWOBP_CHECK(output.numel() == 1, UsageError, "{}: the loss must be a scalar, got {}", where(micro_batch),
                  shape_of(output));
    }
  }
  TWOBP_CHECK(output.requires_grad(), UsageError,
              "{}: the stage output depends on no parameter and no input that requires a gradient",
              where(micro_batch));
  state.output = output;
  micro_batches_.emplace(micro_batch, std::move(state));
  return output.detach();
}

Stage::MicroBatch& Stage::lookup(int micro_batch, const char* action) {
  auto it = micro_batches_.find(micro_batch);
  TWOBP_CHECK(it != micro_batches_.end(), UsageError, "{}: {} called, but this micro-batch has no pending forward F",
              where(micro_batch), action);
  return it->second;
}

at::Tensor Stage::seed_gradient(int micro_batch, const MicroBatch& state, const at::Tensor& grad_output) const {
  const at::Tensor& out = state.output;
  if (!grad_output.defined()) {
    TWOBP_CHECK(out.numel() == 1, UsageError,
                "{}: backward needs the gradient of the output {} (only a scalar loss may omit it)",
                where(micro_batch), shape_of(out));
    return at::full_like(out, options_.loss_scale);
  }
  TWOBP_CHECK(grad_output.sizes() == out.sizes() && grad_output.scalar_type() == out.scalar_type(), UsageError,
              "{}: gradient for the output is {}, but the output is {}", where(micro_batch), shape_of(grad_output),
              shape_of(out));
  TWOBP_CHECK(grad_output.device() == out.device(), UsageError,
              "{}: gradient for the output is on {}, but the output is on {}", where(micro_batch),
              grad_output.device().str(), out.device().str());
  return grad_output;
}

at::Tensor Stage::backward_input(int micro_batch, const at::Tensor& grad_output) {
  MicroBatch& state = lookup(micro_batch, "I (backward_input)");
  TWOBP_CHECK(state.phase == Phase::kForwarded, UsageError,
              "{}: I (backward_input) called twice; the next action for it must be W", where(micro_batch));
  const at::Tensor seed = seed_gradient(micro_batch, state, grad_output);
  store_.set_policy(autograd::WeightGradPolicy::kDeferred);
  detail::InputBackwardResult result =
      detail::run_input_backward({state.output, seed, state.input, store_.anchor(), where(micro_batch)});
  state.plan = std::move(result.plan);
  state.output = at::Tensor();
  state.input = at::Tensor();
  state.phase = Phase::kInputGradDone;
  return result.grad_input;
}

void Stage::backward_weight(const std::vector<int>& micro_batches, const autograd::ParametersDone& done) {
  // Validate every micro-batch before doing any work, so a bad call leaves the stage unchanged.
  std::set<int> seen;
  for (int mb : micro_batches) {
    TWOBP_CHECK(seen.insert(mb).second, UsageError, "{}: W lists this micro-batch twice", where(mb));
    auto it = micro_batches_.find(mb);
    TWOBP_CHECK(it != micro_batches_.end(), UsageError,
                "{}: W called, but this micro-batch has no forward or its weight gradients were already computed",
                where(mb));
    TWOBP_CHECK(it->second.phase == Phase::kInputGradDone, UsageError,
                "{}: W called before I (backward_input) for this micro-batch", where(mb));
  }
  std::vector<std::int64_t> ids(micro_batches.begin(), micro_batches.end());
  // The tensors the general path accumulates in this W: a tensor shared with the fast path is final only at the
  // end, and may not carry a post-accumulate-grad hook (both paths would fire it).
  std::vector<at::Tensor> general_leaves;
  for (int mb : micro_batches) {
    const auto& plan = micro_batches_.at(mb).plan;
    if (plan) general_leaves.insert(general_leaves.end(), plan->leaves.begin(), plan->leaves.end());
  }
  autograd::ParametersDone fast_only;
  if (done) {
    auto general = std::make_shared<std::unordered_set<const c10::TensorImpl*>>();
    for (const auto& leaf : general_leaves) general->insert(leaf.unsafeGetTensorImpl());
    fast_only = [general, &done](const std::vector<at::Tensor>& params) {
      std::vector<at::Tensor> out;
      for (const auto& p : params) {
        if (p.requires_grad() && general->count(p.unsafeGetTensorImpl()) == 0) out.push_back(p);
      }
      if (!out.empty()) done(out);
    };
  }
  store_.run(ids, options_.batch_weight_grads, fast_only, general_leaves);
  for (int mb : micro_batches) {
    auto it = micro_batches_.find(mb);
    if (it->second.plan) detail::run_weight_backward(*it->second.plan);
    micro_batches_.erase(it);
  }
}

at::Tensor Stage::backward(int micro_batch, const at::Tensor& grad_output) {
  MicroBatch& state = lookup(micro_batch, "B (backward)");
  TWOBP_CHECK(state.phase == Phase::kForwarded, UsageError,
              "{}: B (fused backward) called after I already ran; finish it with W", where(micro_batch));
  const at::Tensor seed = seed_gradient(micro_batch, state, grad_output);
  store_.set_policy(autograd::WeightGradPolicy::kImmediate);
  // Exactly output.backward(seed): parameters and the input leaf accumulate their gradients.
  torch::autograd::backward({state.output}, {seed});
  store_.fire_immediate_hooks();  // fast-path parameters' post-accumulate-grad hooks, once each
  at::Tensor grad_input;
  if (state.input.requires_grad()) {
    grad_input = state.input.grad().defined() ? state.input.grad() : at::zeros_like(state.input);
  }
  micro_batches_.erase(micro_batch);
  return grad_input;
}

void Stage::reset() {
  micro_batches_.clear();
  store_.clear();
}

}  // namespace twobp
