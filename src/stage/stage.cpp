#include "twobp/stage.h"

#include "twobp/random.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <mutex>
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

const std::vector<at::Tensor>* Stage::fast_path_parameters() {
  if (!fast_path_decided_) {
    // Once per stage: the parameters the fast-path layers (WeightGradKernels) compute gradients of, and whether
    // they are all the module registers. Frozen or not: requires_grad may change between steps.
    std::unordered_set<const c10::TensorImpl*> fast;
    for (const auto& m : module_->modules()) {
      if (const auto* kernel = dynamic_cast<const autograd::WeightGradKernel*>(m.get())) {
        for (const at::Tensor& p : kernel->weight_grad_parameters()) {
          if (p.defined()) fast.insert(p.unsafeGetTensorImpl());
        }
      }
    }
    const std::vector<at::Tensor> all = parameters();
    const bool only_fast = std::all_of(all.begin(), all.end(),
                                       [&](const at::Tensor& p) { return fast.count(p.unsafeGetTensorImpl()) != 0; });
    if (only_fast) fast_path_parameters_ = all;
    fast_path_decided_ = true;
    fast_only_ = only_fast;
  }
  return fast_only_ ? &fast_path_parameters_ : nullptr;
}

std::size_t Stage::pending_weight_micro_batches() const {
  std::size_t n = 0;
  for (const auto& [mb, state] : micro_batches_) n += state.phase == Phase::kInputGradDone ? 1 : 0;
  return n;
}

NamedTensors StageForward::call(const NamedTensors& inputs, std::string_view where) const {
  if (multi_) return multi_(inputs);
  return NamedTensors(single_(inputs.single(fmt::format("{}: the one-tensor forward's input", where))));
}

at::Tensor LossFunction::call(const NamedTensors& outputs, const NamedTensors& targets, std::string_view where) const {
  if (multi_) return multi_(outputs, targets);
  return single_(outputs.single(fmt::format("{}: the one-tensor loss's output", where)),
                 targets.single(fmt::format("{}: the one-tensor loss's target", where)));
}

NamedTensors Stage::forward(int micro_batch, const NamedTensors& inputs, const NamedTensors& targets) {
  TWOBP_CHECK(micro_batches_.count(micro_batch) == 0, UsageError,
              "{}: F called again before the backward of its previous F ran", where(micro_batch));
  TWOBP_CHECK(!inputs.empty(), UsageError, "{}: F got no input tensor", where(micro_batch));
  MicroBatch state;
  for (const auto& [name, tensor] : inputs) {
    TWOBP_CHECK(tensor.defined(), UsageError, "{}: F got an undefined input tensor '{}'", where(micro_batch), name);
    // The first stage's inputs are data (token ids, images): no gradient is sent upstream from them.
    const bool input_grad = options_.stage_index > 0 && tensor.is_floating_point() && tensor.requires_grad();
    state.inputs.add(name, input_grad ? tensor.detach().requires_grad_(true) : tensor.detach());
  }
  state.pass = passes_[micro_batch]++;
  // Recomputation replays the forward with the random state it starts from (dropout draws the same mask): the
  // stage's own streams by their key (run_forward), the replay generators -- and, with one rank per process, the
  // default generators -- by their captured state.
  if (options_.recompute) state.rng = detail::RngState::capture(replayed_generators());
  NamedTensors outputs = refusing_default_draws(
      micro_batch, [&] { return run_forward(micro_batch, state.pass, state.inputs, targets); });
  // Outputs that carry no gradient at all (every parameter up to here frozen: a frozen encoder or embedding on the
  // first stages) make this micro-batch's I and W no-ops here. A loss that carries none would train nothing; as
  // loss.backward() does, refuse it.
  TWOBP_CHECK(!options_.loss || outputs.entry(0).tensor.requires_grad(), UsageError,
              "{}: the loss does not depend on any trainable parameter (every parameter of this and the earlier stages "
              "is frozen, or none of the outputs reaching this stage carries a gradient); there is nothing to train",
              where(micro_batch));
  NamedTensors detached;
  for (const auto& [name, tensor] : outputs) {
    detached.add(name, tensor.requires_grad() ? tensor.detach().requires_grad_(true) : tensor.detach());
  }
  if (options_.recompute) {
    // Only the inputs (and targets) stay alive; the graph and its saved activations go with `outputs`.
    state.targets = targets;
    state.forwarded = detached;
    state.recompute_pending = true;
  } else {
    state.outputs = std::move(outputs);
  }
  micro_batches_.emplace(micro_batch, std::move(state));
  return detached;
}

NamedTensors Stage::refusing_default_draws(int micro_batch, const std::function<NamedTensors()>& body) {
  // Ranks as threads: LibTorch's default generators are shared with the other ranks' threads, and draws from them
  // interleave differently in every run. Nothing silently irreproducible: refuse a forward that drew from one.
  if (!options_.ranks_share_process) return body();
  const detail::RngState before = detail::RngState::capture(detail::RngState::defaults(device()));
  NamedTensors outputs = body();
  TWOBP_CHECK(before.now().same_as(before), UsageError,
              "{}: LibTorch's default random generator was drawn from during this forward (by the forward itself, "
              "e.g. torch::nn::Dropout or torch::rand, or by another thread of this process), while the ranks run as "
              "threads of one process: their draws interleave differently in every run, so results would not be "
              "reproducible. Draw from the stage's own generator instead (twobp::nn::Dropout, "
              "twobp::stage_generator(); twobp/random.h), or run one rank per process (mpirun, torchrun)",
              where(micro_batch));
  return outputs;
}

NamedTensors Stage::evaluate(int micro_batch, const NamedTensors& inputs, const NamedTensors& targets) {
  TWOBP_CHECK(!inputs.empty(), UsageError, "{}: evaluation got no input tensor", where(micro_batch));
  NamedTensors detached;
  for (const auto& [name, tensor] : inputs) {
    TWOBP_CHECK(tensor.defined(), UsageError, "{}: evaluation got an undefined input tensor '{}'", where(micro_batch),
                name);
    detached.add(name, tensor.detach());
  }
  return refusing_default_draws(micro_batch, [&] {
    // No graph: GradMode off also sends the fast-path layers down their plain ATen path (nothing is recorded).
    c10::AutoGradMode no_grad(false);
    StageRandomScope random(options_.seed, options_.stage_index, micro_batch, /*pass=*/-1);
    return call_forward(micro_batch, detached, targets);
  });
}

std::vector<at::Generator> Stage::replayed_generators() const {
  std::vector<at::Generator> generators;
  if (!options_.ranks_share_process) generators = detail::RngState::defaults(device());
  generators.insert(generators.end(), options_.replay_generators.begin(), options_.replay_generators.end());
  return generators;
}

NamedTensors Stage::run_forward(int micro_batch, int64_t pass, const NamedTensors& inputs,
                                const NamedTensors& targets) {
  c10::AutoGradMode grad_mode(true);
  StageRandomScope random(options_.seed, options_.stage_index, micro_batch, pass);
  autograd::RecordingScope scope(store_, micro_batch);
  NamedTensors outputs = call_forward(micro_batch, inputs, targets);
  for (auto& [name, tensor] : outputs) {
    // An output that is a leaf (an input passed through, a parameter) gets a node of its own, so that its
    // gradient reaches the leaf through the graph like any other output's.
    if (tensor.requires_grad() && tensor.grad_fn() == nullptr) tensor = tensor.view_as(tensor);
  }
  return outputs;
}

NamedTensors Stage::call_forward(int micro_batch, const NamedTensors& inputs, const NamedTensors& targets) {
  const bool last = static_cast<bool>(options_.loss);
  NamedTensors fn_inputs = inputs;
  if (last && forward_.takes_named_tensors()) {
    for (const auto& [name, tensor] : targets) {
      TWOBP_CHECK(!fn_inputs.contains(name), UsageError,
                  "{}: the target '{}' has the name of an input of the last stage ({{{}}}); rename one of them",
                  where(micro_batch), name, inputs.describe());
      fn_inputs.add(name, tensor);
    }
  }
  NamedTensors outputs;
  try {
    outputs = forward_.call(fn_inputs, where(micro_batch));
  } catch (const UsageError& e) {
    // twobp's own errors inside the user's forward (a name missing from the inputs) say where they happened.
    const std::string here = where(micro_batch);
    if (std::string_view(e.what()).rfind(here, 0) == 0) throw;
    throw UsageError(fmt::format("{}: in the stage's forward: {}", here, e.what()));
  }
  TWOBP_CHECK(!outputs.empty(), UsageError, "{}: the forward returned no tensor", where(micro_batch));
  if (last) {
    TWOBP_CHECK(!targets.empty(), UsageError, "{}: the last stage computes a loss and needs a target",
                where(micro_batch));
    at::Tensor loss = options_.loss.call(outputs, targets, where(micro_batch));
    TWOBP_CHECK(loss.defined() && loss.numel() == 1 && loss.is_floating_point(), UsageError,
                "{}: the loss must be a floating-point scalar, got {}", where(micro_batch), shape_of(loss));
    outputs = NamedTensors{{"loss", loss}};
  }
  for (const auto& [name, tensor] : outputs) {
    TWOBP_CHECK(tensor.defined(), UsageError, "{}: the forward returned an undefined tensor '{}'", where(micro_batch),
                name);
  }
  return outputs;
}

void Stage::recompute(int micro_batch, MicroBatch& state) {
  if (!state.recompute_pending) return;
  const auto t0 = std::chrono::steady_clock::now();
  // Replay with F's random state, then continue the random stream where it was; buffers (BatchNorm running
  // statistics) are put back, so that they are updated once per micro-batch, by F, as without recomputation.
  const detail::RngState now = state.rng.now();
  state.rng.restore();
  std::vector<at::Tensor> buffers = module_->buffers(), saved;
  for (const auto& b : buffers) saved.push_back(b.clone());
  try {
    state.outputs = run_forward(micro_batch, state.pass, state.inputs, state.targets);
  } catch (...) {
    now.restore();
    throw;
  }
  {
    // Below autograd's in-place tracking: the values go back, the version counters stay. The replayed graph saved
    // some buffers for its backward (batch_norm saves the running statistics); a tracked copy_ would bump their
    // versions and that backward would refuse them as "modified by an inplace operation". The gradients do not
    // depend on it: in training mode batch_norm's backward reads the batch statistics it saved, not the running
    // ones; in eval mode the forward leaves the buffers as they were, and the values put back are the same.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (std::size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(saved[k]);
  }
  now.restore();
  check_recomputed(micro_batch, state);
  state.targets = NamedTensors();
  state.forwarded = NamedTensors();
  state.recompute_pending = false;
  verify_recomputed();
  recompute_us_ += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

void Stage::check_recomputed(int micro_batch, const MicroBatch& state) {
  // Reproducible forwards give the same outputs up to the order of floating-point sums (nondeterministic GPU
  // kernels): a relative difference of a few units of the dtype's precision. A mask drawn anew, or any other
  // change of what the forward computes, differs by much more.
  c10::AutoGradMode no_grad(false);
  for (std::size_t k = 0; k < state.outputs.size(); ++k) {
    const auto& [name, again] = state.outputs.entry(k);
    const at::Tensor& first = state.forwarded.entry(k).tensor;
    if (again.numel() == 0) continue;
    RecomputeCheck check{micro_batch, name.empty() ? std::string("output") : name, 0.0, {}};
    if (!again.is_floating_point()) {
      const at::Tensor differs = at::ne(again.detach(), first).any().to(at::kDouble);
      check.errors = at::stack({differs, at::zeros_like(differs)});
    } else {
      const at::Tensor a = again.detach().to(at::kDouble), f = first.to(at::kDouble);
      check.errors = at::stack({(a - f).norm(), f.norm()});
      const std::size_t bytes = c10::elementSize(again.scalar_type());
      check.tolerance = bytes <= 2 ? 5e-2 : bytes == 4 ? 1e-3 : 1e-6;  // bf16/fp16, fp32, fp64
    }
    recompute_checks_.push_back(std::move(check));
  }
}

void Stage::verify_recomputed() {
  if (recompute_checks_.empty()) return;
  for (const auto& [mb, state] : micro_batches_) {
    if (state.recompute_pending) return;  // more to come: read them together
  }
  std::vector<RecomputeCheck> checks = std::move(recompute_checks_);
  recompute_checks_.clear();
  std::vector<at::Tensor> errors;
  for (const auto& c : checks) errors.push_back(c.errors.to(at::kCPU));  // no-op on the CPU
  // SYNC POINT (recomputation only): the comparisons of every re-run since the last read, in one copy on a GPU.
  const at::Tensor host = at::stack(errors).contiguous();
  const double* e = host.data_ptr<double>();
  for (std::size_t k = 0; k < checks.size(); ++k) {
    const double diff = e[2 * k], scale = e[2 * k + 1];
    const RecomputeCheck& c = checks[k];
    TWOBP_CHECK(diff <= c.tolerance * scale + 1e-12, UsageError,
                "{}: with StageOptions::recompute the forward ran again before I/B and returned another '{}' "
                "({}): it draws from a generator that is not replayed (list it in "
                "StageOptions::replay_generators or PipelineChunk::replay_generators) or is otherwise not "
                "reproducible; or turn recomputation off for this stage",
                where(c.micro_batch), c.name,
                c.tolerance == 0.0 ? std::string("integer values differ")
                                   : fmt::format("relative difference {:.3g}", scale > 0 ? diff / scale : diff));
  }
}

double Stage::take_recompute_us() {
  const double us = recompute_us_;
  recompute_us_ = 0.0;
  return us;
}

c10::Device Stage::device() const {
  for (const auto& p : module_->parameters()) return p.device();
  return c10::Device(c10::kCPU);
}

namespace detail {

std::vector<at::Generator> RngState::defaults(c10::Device device) {
  std::vector<at::Generator> generators{at::detail::getDefaultCPUGenerator()};
  if (!device.is_cpu()) generators.push_back(at::globalContext().defaultGenerator(device));
  return generators;
}

RngState RngState::capture(const std::vector<at::Generator>& generators) {
  RngState s;
  for (const auto& generator : generators) {
    at::Generator g = generator;
    std::lock_guard<std::mutex> lock(g.mutex());
    s.states.emplace_back(g, g.get_state());
  }
  return s;
}

RngState RngState::now() const {
  std::vector<at::Generator> generators;
  for (const auto& [generator, state] : states) generators.push_back(generator);
  return capture(generators);
}

void RngState::restore() const {
  for (const auto& [generator, state] : states) {
    at::Generator g = generator;
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

bool RngState::same_as(const RngState& other) const {
  if (states.size() != other.states.size()) return false;
  for (std::size_t k = 0; k < states.size(); ++k) {
    if (states[k].first != other.states[k].first || !at::equal(states[k].second, other.states[k].second)) return false;
  }
  return true;
}

}  // namespace detail

at::Tensor Stage::forward(int micro_batch, const at::Tensor& input, const at::Tensor& target) {
  TWOBP_CHECK(input.defined(), UsageError, "{}: F got an undefined input tensor", where(micro_batch));
  const bool input_grad = options_.stage_index > 0 && input.is_floating_point();
  NamedTensors targets;
  if (target.defined()) targets = NamedTensors(target);
  return forward(micro_batch, NamedTensors(input.detach().requires_grad_(input_grad)), targets)
      .single(where(micro_batch))
      .detach();
}

Stage::MicroBatch& Stage::lookup(int micro_batch, const char* action) {
  auto it = micro_batches_.find(micro_batch);
  TWOBP_CHECK(it != micro_batches_.end(), UsageError, "{}: {} called, but this micro-batch has no pending forward F",
              where(micro_batch), action);
  return it->second;
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> Stage::seeds(int micro_batch, const MicroBatch& state,
                                                                         const NamedTensors& grad_outputs) const {
  std::vector<at::Tensor> roots, grads;
  bool any_gradient = false;
  for (const auto& entry : state.outputs) any_gradient = any_gradient || entry.tensor.requires_grad();
  if (grad_outputs.empty() && !any_gradient) return {};  // no output carries a gradient: nothing to seed
  if (grad_outputs.empty()) {
    // Empty means "seed the scalar loss"; an output that got no gradient is named with an undefined tensor.
    TWOBP_CHECK(state.outputs.size() == 1 && state.outputs.entry(0).tensor.numel() == 1, UsageError,
                "{}: backward needs the gradients of the outputs {{{}}} (only a scalar loss may omit them; name an "
                "output with an undefined tensor to say that it got no gradient)",
                where(micro_batch), state.outputs.describe());
    const at::Tensor& loss = state.outputs.entry(0).tensor;
    return {{loss}, {at::full_like(loss, options_.loss_scale)}};
  }
  for (const auto& [name, grad] : grad_outputs) {
    TWOBP_CHECK(state.outputs.contains(name), UsageError,
                "{}: got a gradient for '{}', which is not an output of this stage ({{{}}})", where(micro_batch),
                name, state.outputs.describe());
    if (!grad.defined()) continue;
    const at::Tensor& out = state.outputs[name];
    TWOBP_CHECK(out.requires_grad(), UsageError,
                "{}: got a gradient for output '{}', which carries none (it does not require grad)",
                where(micro_batch), name);
    TWOBP_CHECK(grad.sizes() == out.sizes() && grad.scalar_type() == out.scalar_type(), UsageError,
                "{}: gradient for output '{}' is {}, but the output is {}", where(micro_batch), name,
                shape_of(grad), shape_of(out));
    TWOBP_CHECK(grad.device() == out.device(), UsageError,
                "{}: gradient for output '{}' is on {}, but the output is on {}", where(micro_batch), name,
                grad.device().str(), out.device().str());
    roots.push_back(out);
    grads.push_back(grad);
  }
  return {roots, grads};
}

std::vector<at::Tensor> Stage::gradient_inputs(const MicroBatch& state, std::vector<std::string>* names) {
  std::vector<at::Tensor> out;
  for (const auto& [name, tensor] : state.inputs) {
    if (!tensor.requires_grad()) continue;
    out.push_back(tensor);
    names->push_back(name);
  }
  return out;
}

NamedTensors Stage::backward_input(int micro_batch, const NamedTensors& grad_outputs) {
  MicroBatch& state = lookup(micro_batch, "I (backward_input)");
  TWOBP_CHECK(state.phase == Phase::kForwarded, UsageError,
              "{}: I (backward_input) called twice; the next action for it must be W", where(micro_batch));
  recompute(micro_batch, state);
  auto [roots, grads] = seeds(micro_batch, state, grad_outputs);
  std::vector<std::string> names;
  std::vector<at::Tensor> inputs = gradient_inputs(state, &names);
  NamedTensors result;
  if (!roots.empty()) {
    store_.set_policy(autograd::WeightGradPolicy::kDeferred);
    detail::InputBackwardRequest request{std::move(roots), std::move(grads), inputs, store_.anchor(),
                                         where(micro_batch)};
    request.fast_path_parameters = fast_path_parameters();
    detail::InputBackwardResult r = detail::run_input_backward(request);
    state.plan = std::move(r.plan);
    for (std::size_t i = 0; i < names.size(); ++i) result.add(names[i], r.grad_inputs[i]);
  } else {
    for (const auto& name : names) result.add(name, at::Tensor());  // nothing downstream used any output
  }
  state.outputs = NamedTensors();
  state.inputs = NamedTensors();
  state.phase = Phase::kInputGradDone;
  return result;
}

at::Tensor Stage::backward_input(int micro_batch, const at::Tensor& grad_output) {
  const SingleCall call = single_call(micro_batch, "I (backward_input)", grad_output);
  return single_gradient(micro_batch, call, backward_input(micro_batch, call.grad_outputs));
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

NamedTensors Stage::backward(int micro_batch, const NamedTensors& grad_outputs) {
  MicroBatch& state = lookup(micro_batch, "B (backward)");
  TWOBP_CHECK(state.phase == Phase::kForwarded, UsageError,
              "{}: B (fused backward) called after I already ran; finish it with W", where(micro_batch));
  recompute(micro_batch, state);
  auto [roots, grads] = seeds(micro_batch, state, grad_outputs);
  std::vector<std::string> names;
  std::vector<at::Tensor> inputs = gradient_inputs(state, &names);
  if (!roots.empty()) {
    store_.set_policy(autograd::WeightGradPolicy::kImmediate);
    // Exactly sum(outputs * seeds).backward(): parameters and the input leaves accumulate their gradients.
    torch::autograd::backward(roots, grads);
    store_.fire_immediate_hooks();  // fast-path parameters' post-accumulate-grad hooks, once each
  }
  NamedTensors result;
  for (std::size_t i = 0; i < names.size(); ++i) result.add(names[i], inputs[i].grad());
  micro_batches_.erase(micro_batch);
  return result;
}

at::Tensor Stage::backward(int micro_batch, const at::Tensor& grad_output) {
  const SingleCall call = single_call(micro_batch, "B (backward)", grad_output);
  return single_gradient(micro_batch, call, backward(micro_batch, call.grad_outputs));
}

Stage::SingleCall Stage::single_call(int micro_batch, const char* action, const at::Tensor& grad_output) {
  MicroBatch& state = lookup(micro_batch, action);
  if (state.phase == Phase::kForwarded) recompute(micro_batch, state);  // the outputs name the gradient
  SingleCall call;
  if (state.inputs.size() == 1) call.input = state.inputs.entry(0).tensor;
  if (grad_output.defined()) {
    TWOBP_CHECK(state.outputs.size() == 1, UsageError,
                "{}: the one-tensor {} got one gradient for the outputs {{{}}}; use the NamedTensors form",
                where(micro_batch), action, state.outputs.describe());
    call.grad_outputs = NamedTensors{{state.outputs.entry(0).name, grad_output}};
  }
  return call;
}

at::Tensor Stage::single_gradient(int micro_batch, const SingleCall& call, const NamedTensors& grads) const {
  if (grads.empty()) return at::Tensor();
  TWOBP_CHECK(grads.size() == 1, UsageError,
              "{}: the one-tensor backward was used on a stage whose inputs are {{{}}}; use the NamedTensors form",
              where(micro_batch), grads.describe());
  // The one-tensor contract: zeros for an input no output depends on (the NamedTensors form says "undefined").
  const at::Tensor& g = grads.entry(0).tensor;
  return g.defined() ? g : at::zeros_like(call.input);
}

void Stage::set_recompute(bool on) {
  TWOBP_CHECK(micro_batches_.empty(), UsageError,
              "rank {} stage {}: recomputation can be switched between steps only; the stage holds {} micro-batch(es) "
              "of a step that has not finished (micro-batch {} first)",
              options_.rank, options_.stage_index, micro_batches_.size(), micro_batches_.begin()->first);
  options_.recompute = on;
}

void Stage::set_loss_scale(double scale) {
  TWOBP_CHECK(micro_batches_.empty(), UsageError,
              "rank {} stage {}: the loss scale can be set between steps only; the stage holds {} micro-batch(es) of "
              "a step that has not finished",
              options_.rank, options_.stage_index, micro_batches_.size());
  TWOBP_CHECK(std::isfinite(scale) && scale > 0, UsageError, "rank {} stage {}: loss scale {} is not a positive number",
              options_.rank, options_.stage_index, scale);
  options_.loss_scale = scale;
}

void Stage::reset() {
  micro_batches_.clear();
  recompute_us_ = 0.0;
  recompute_checks_.clear();
  store_.clear();
}

}  // namespace twobp
