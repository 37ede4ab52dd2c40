#pragma once
// Classes of modules the 2BP split must get exactly right (or reject on the first step), shared by the Stage
// tests (tests/autograd) and the pipeline tests (tests/runtime). Each class is a [batch, seq, dim] -> same-shape
// module, so any number of them can be chained into a pipeline; each mixes fast-path (twobp::nn) and general-path
// (torch::nn) layers so both halves of the split meet the pattern.
//
// A module may expose `extras()`: tensors that are not parameters of the module but whose values must equal the
// reference's too (gradients of unregistered leaves, a retained gradient, what a hook saw).

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "twobp/models/llama.h"
#include "twobp/nn.h"

namespace twobp::testing {

/// A module whose extras() are compared with the reference's after a run.
struct CaseModule : torch::nn::Module {
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  virtual std::vector<torch::Tensor> extras() { return {}; }
};

/// The same submodule registered under two names: Module::parameters() lists its tensors twice.
struct RegisteredTwice : CaseModule {
  explicit RegisteredTwice(int64_t dim) {
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    register_module("fast_again", fast.ptr());
    general = register_module("general", torch::nn::Linear(dim, dim));
    register_module("general_again", general.ptr());
  }
  torch::Tensor forward(const torch::Tensor& x) override { return general(torch::tanh(fast(x))) + x; }
  twobp::nn::Linear fast{nullptr};
  torch::nn::Linear general{nullptr};
};

/// Frozen parameters (requires_grad false) on both paths: whole fast layers, a fast layer with only its bias
/// trainable, a frozen RMSNorm scale, a general layer with a frozen weight. Their .grad must stay undefined.
struct Frozen : CaseModule {
  explicit Frozen(int64_t dim) {
    fast_frozen = register_module("fast_frozen", twobp::nn::Linear(dim, dim));
    fast_bias_only = register_module("fast_bias_only", twobp::nn::Linear(dim, dim));
    norm = register_module("norm", twobp::nn::RMSNorm(dim));
    general = register_module("general", torch::nn::Linear(dim, dim));
    fast_frozen->weight.set_requires_grad(false);
    fast_frozen->bias.set_requires_grad(false);
    fast_bias_only->weight.set_requires_grad(false);
    norm->weight.set_requires_grad(false);
    general->weight.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = norm(torch::tanh(fast_frozen(x)));
    return general(fast_bias_only(h)) + x;
  }
  twobp::nn::Linear fast_frozen{nullptr}, fast_bias_only{nullptr};
  twobp::nn::RMSNorm norm{nullptr};
  torch::nn::Linear general{nullptr};
};

/// Layers whose input depends on parameters only (a learned query): fast Linear and RMSNorm, and a general Linear.
struct ParameterOnlyInput : CaseModule {
  explicit ParameterOnlyInput(int64_t dim) {
    query = register_parameter("query", torch::randn({1, 1, dim}));
    norm = register_module("norm", twobp::nn::RMSNorm(dim));
    proj = register_module("proj", twobp::nn::Linear(dim, dim));
    general = register_module("general", torch::nn::Linear(dim, dim));
    fc = register_module("fc", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto q = query.expand({x.size(0), x.size(1), x.size(2)});
    return fc(x) * torch::sigmoid(proj(norm(q))) + general(q);
  }
  torch::Tensor query;
  twobp::nn::RMSNorm norm{nullptr};
  twobp::nn::Linear proj{nullptr}, fc{nullptr};
  torch::nn::Linear general{nullptr};
};

/// Records, per call, the sum of the gradient a post-accumulate-grad hook saw in .grad.
struct RecordingPostAccumulateHook : torch::autograd::PostAccumulateGradHook {
  explicit RecordingPostAccumulateHook(std::shared_ptr<std::vector<double>> seen) : seen(std::move(seen)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    seen->push_back(tensor.grad().sum().item<double>());
  }
  std::shared_ptr<std::vector<double>> seen;
};

/// Hooks the split must run exactly as often as loss.backward(): a tensor hook and retain_grad() on the output
/// of a weight-bearing node (the split's frontier), a tensor hook on a weight-side intermediate, a gradient hook
/// on a general-path parameter and a post-accumulate-grad hook on another.
struct Hooked : CaseModule {
  explicit Hooked(int64_t dim) {
    scale = register_parameter("scale", torch::randn({dim}));
    shift = register_parameter("shift", torch::randn({dim}));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    general = register_module("general", torch::nn::Linear(dim, dim));
    scale.register_hook([](const torch::Tensor& g) { return g * 0.5; });
    torch::autograd::impl::set_post_acc_grad_hooks(general->weight,
                                                   std::make_unique<RecordingPostAccumulateHook>(post_accumulate));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = fast(x) * scale;  // MulBackward with an edge to `scale`: a frontier node
    h.register_hook([](const torch::Tensor& g) { return g * 2.0; });
    h.retain_grad();
    retained = h;
    auto s = shift * 3.0;  // weight side only
    s.register_hook([](const torch::Tensor& g) { return g + 1.0; });
    return general(torch::tanh(h)) + s + x;
  }
  // The hook's call count and the last .grad it saw (intermediate values depend on the order W visits
  // micro-batches in, which a schedule may choose freely).
  std::vector<torch::Tensor> extras() override {
    return {retained.grad(), torch::tensor({static_cast<double>(post_accumulate->size()),
                                            post_accumulate->empty() ? 0.0 : post_accumulate->back()},
                                           torch::kDouble)};
  }
  torch::Tensor scale, shift, retained;
  twobp::nn::Linear fast{nullptr};
  torch::nn::Linear general{nullptr};
  std::shared_ptr<std::vector<double>> post_accumulate = std::make_shared<std::vector<double>>();
};

/// In-place updates of views that 2BP handles: a constant factor on a view of an activation, and an in-place
/// update of a view of a weight-side tensor (whole CopySlices on the weight side).
struct InPlaceViews : CaseModule {
  explicit InPlaceViews(int64_t dim) {
    scale = register_parameter("scale", torch::randn({dim}));
    general = register_module("general", torch::nn::Linear(dim, dim));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = general(x);
    h.narrow(-1, 0, 2).mul_(3.0);
    auto w = scale * 1.0;
    w.narrow(0, 0, 2).mul_(2.0 + torch::tanh(scale.narrow(0, 2, 2)));
    return fast(h * w) + x;
  }
  torch::Tensor scale;
  torch::nn::Linear general{nullptr};
  twobp::nn::Linear fast{nullptr};
};

/// Trainable leaves the forward uses without registering them: a free tensor and another module's parameters.
struct UnregisteredLeaves : CaseModule {
  explicit UnregisteredLeaves(int64_t dim)
      : free_leaf(torch::randn({dim}).requires_grad_(true)), other(torch::nn::Linear(dim, dim)) {
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fast(other(x) * free_leaf) + x; }
  std::vector<torch::Tensor> extras() override {
    return {free_leaf.grad(), other->weight.grad(), other->bias.grad()};
  }
  torch::Tensor free_leaf;
  torch::nn::Linear other;
  twobp::nn::Linear fast{nullptr};
};

/// Dropout on the general path with an explicit generator (so that pipeline ranks on threads draw the same masks
/// as the reference: each chunk draws in micro-batch order from its own generator).
struct Dropped : CaseModule {
  explicit Dropped(int64_t dim) : generator(at::detail::createCPUGenerator(99)) {
    general = register_module("general", torch::nn::Linear(dim, dim));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = general(x);
    auto keep = at::bernoulli(torch::full_like(h, 0.7), generator);
    return fast(h * keep / 0.7) + x;
  }
  at::Generator generator;
  torch::nn::Linear general{nullptr};
  twobp::nn::Linear fast{nullptr};
};

/// Dropout drawing from the stage's own generator (twobp::nn::Dropout, twobp/random.h): the reference draws the
/// same masks by opening the same StageRandomScope around each chunk's forward.
struct StageDropout : CaseModule {
  explicit StageDropout(int64_t dim) {
    general = register_module("general", torch::nn::Linear(dim, dim));
    drop = register_module("drop", twobp::nn::Dropout(0.4));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fast(drop(torch::tanh(general(x)))) + x; }
  torch::nn::Linear general{nullptr};
  twobp::nn::Dropout drop{nullptr};
  twobp::nn::Linear fast{nullptr};
};

/// Modules whose forward updates buffers in place: BatchNorm1d and InstanceNorm1d with running statistics (the
/// kernels update them; batch_norm saves them for its backward), and a counter a forward increments.
struct Normalized : CaseModule {
  explicit Normalized(int64_t dim) {
    batch_norm = register_module("batch_norm", torch::nn::BatchNorm1d(dim));
    instance_norm = register_module(
        "instance_norm", torch::nn::InstanceNorm1d(torch::nn::InstanceNorm1dOptions(dim).affine(true).track_running_stats(true)));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    forwards = register_buffer("forwards", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) override {  // x: [batch, seq, dim]; the norms want [batch, dim, seq]
    {
      torch::NoGradGuard no_grad;
      forwards.add_(1);
    }
    auto h = batch_norm(fast(x).transpose(1, 2));
    return instance_norm(h).transpose(1, 2) + x;
  }
  torch::nn::BatchNorm1d batch_norm{nullptr};
  torch::nn::InstanceNorm1d instance_norm{nullptr};
  twobp::nn::Linear fast{nullptr};
  torch::Tensor forwards;
};

/// In-place update of a view of an activation with a parameter operand: a CopySlices node on the split's frontier
/// (its edges and its wrapped function's are cut alike).
struct InPlaceViewWithParameter : CaseModule {
  explicit InPlaceViewWithParameter(int64_t dim) {
    scale = register_parameter("scale", torch::randn({2}));
    general = register_module("general", torch::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = general(x);
    h.narrow(-1, 0, 2).mul_(scale);
    return h + x;
  }
  torch::Tensor scale;
  torch::nn::Linear general{nullptr};
};

/// Several ordinary LibTorch modules with multi-output nodes and saved state: LSTM, multi-head attention, GRU cell
/// style gating, LayerNorm, and an Embedding with sparse gradients indexed by ids derived from the activation.
struct TorchZoo : CaseModule {
  explicit TorchZoo(int64_t dim) {
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(dim, dim).batch_first(true)));
    attn = register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(dim, 2)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    table = register_module("table", torch::nn::Embedding(torch::nn::EmbeddingOptions(7, dim).sparse(true)));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = std::get<0>(lstm(x));
    auto t = h.transpose(0, 1);  // [seq, batch, dim]
    auto a = std::get<0>(attn(t, t, t)).transpose(0, 1);
    auto ids = x.detach().select(-1, 0).abs().mul(3).floor().clamp_max(6).to(torch::kLong);
    return fast(norm(a + h)) + table(ids) + x;
  }
  torch::nn::LSTM lstm{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Embedding table{nullptr};
  twobp::nn::Linear fast{nullptr};
};

/// One parameter used by a fast-path layer and by ordinary ops (its gradient comes from the store and from the
/// autograd graph and must be the sum), and a fast layer applied twice.
struct SharedAcrossPaths : CaseModule {
  explicit SharedAcrossPaths(int64_t dim) { fc = register_module("fc", twobp::nn::Linear(dim, dim)); }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = fc(torch::tanh(fc(x)));
    return h + torch::matmul(x, fc->weight.t()) * fc->bias.sum();
  }
  twobp::nn::Linear fc{nullptr};
};

/// Moves the gradient out at every accumulation (optimizer-in-backward style): adds .grad to `moved`, then
/// resets .grad. It must see each micro-batch's gradient alone, as AccumulateGrad gives it in loss.backward().
struct MovingPostAccumulateHook : torch::autograd::PostAccumulateGradHook {
  explicit MovingPostAccumulateHook(std::shared_ptr<torch::Tensor> moved) : moved(std::move(moved)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    *moved = moved->defined() ? *moved + tensor.grad() : tensor.grad().clone();
    const_cast<torch::autograd::Variable&>(tensor).mutable_grad().reset();
  }
  std::shared_ptr<torch::Tensor> moved;
};

/// Post-accumulate-grad hooks on fast-path parameters: a recording hook on a Linear applied twice (a tied use:
/// one firing per micro-batch), and a hook that moves an RMSNorm's gradient out and resets .grad.
struct FastHooked : CaseModule {
  explicit FastHooked(int64_t dim) {
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    norm = register_module("norm", twobp::nn::RMSNorm(dim));
    torch::autograd::impl::set_post_acc_grad_hooks(fast->weight, std::make_unique<RecordingPostAccumulateHook>(seen));
    torch::autograd::impl::set_post_acc_grad_hooks(norm->weight, std::make_unique<MovingPostAccumulateHook>(moved));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return norm(fast(torch::tanh(fast(x)))) + x; }
  // The count, the last .grad sum seen (the gradient accumulates, so the last one is the total whatever the
  // micro-batch order), and what was moved out.
  std::vector<torch::Tensor> extras() override {
    return {torch::tensor({static_cast<double>(seen->size()), seen->empty() ? 0.0 : seen->back()}, torch::kDouble),
            *moved};
  }
  twobp::nn::Linear fast{nullptr};
  twobp::nn::RMSNorm norm{nullptr};
  std::shared_ptr<std::vector<double>> seen = std::make_shared<std::vector<double>>();
  std::shared_ptr<torch::Tensor> moved = std::make_shared<torch::Tensor>();
};

/// Data-dependent routing (mixture-of-experts style, top-1 of a trainable router): each expert runs only on the
/// tokens routed to it, so an expert may get no token in a micro-batch (it then stays out of that micro-batch's
/// graph), and one expert is never used (its .grad stays undefined although it is trainable).
struct Routed : CaseModule {
  explicit Routed(int64_t dim) {
    router = register_module("router", torch::nn::Linear(dim, 3));
    general = register_module("general", torch::nn::Linear(dim, dim));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    never = register_module("never", torch::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto flat = x.reshape({-1, x.size(-1)});
    auto gate = torch::softmax(router(flat), 1);
    auto top = std::get<1>(gate.max(1));
    auto out = torch::zeros_like(flat);
    for (int e = 0; e < 3; ++e) {
      auto idx = (top == e).nonzero().squeeze(1);
      if (idx.numel() == 0) continue;
      auto xe = flat.index_select(0, idx);
      auto ye = e == 0 ? general(xe) : e == 1 ? fast(xe) : xe;  // route 2: a pass-through; `never` is never run
      out = out.index_add(0, idx, ye * gate.index_select(0, idx).select(1, e).unsqueeze(1));
    }
    return out.reshape(x.sizes()) + x;
  }
  torch::nn::Linear router{nullptr}, general{nullptr}, never{nullptr};
  twobp::nn::Linear fast{nullptr};
};

/// A user-written autograd function (torch::autograd::Function with its own backward) taking an activation and a
/// parameter, saving both.
struct ScaleFunction : torch::autograd::Function<ScaleFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    return {grads[0] * saved[1], (grads[0] * saved[0]).sum_to_size(saved[1].sizes())};
  }
};
struct CustomFunction : CaseModule {
  explicit CustomFunction(int64_t dim) {
    scale = register_parameter("scale", torch::randn({dim}));
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fast(ScaleFunction::apply(torch::tanh(x), scale)) + x;
  }
  torch::Tensor scale;
  twobp::nn::Linear fast{nullptr};
};

/// A parameter whose storage is not contiguous (a transposed tensor): its .grad must have its values whatever the
/// layout the split gives it.
struct NonContiguousParameter : CaseModule {
  explicit NonContiguousParameter(int64_t dim) {
    weight = register_parameter("weight", torch::randn({dim, dim}).t());
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fast(torch::matmul(x, weight)) + x; }
  torch::Tensor weight;
  twobp::nn::Linear fast{nullptr};
};

/// Two blocks of the library's LLaMa model (twobp::models): only fast-path layers, so I runs without the graph
/// analysis; rotary embedding as one autograd node from tables the blocks share; the second block's angles follow
/// positions (packed documents restart them), the first's 0..seq-1.
struct LlamaBlocks : CaseModule {
  explicit LlamaBlocks(int64_t dim) {
    models::LlamaConfig c;
    c.name = "case";
    c.dim = dim;
    c.n_layers = 2;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.ffn_dim = dim + 2;
    c.vocab_size = 8;
    c.max_seq_len = 8;
    auto rotary = std::make_shared<const twobp::nn::RotaryEmbedding>(c.head_dim(), c.rope_theta, c.max_seq_len);
    first = register_module("first", models::LlamaBlock(c, rotary));
    second = register_module("second", models::LlamaBlock(c, rotary));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    const auto positions = (torch::arange(x.size(1)) % 2).expand({x.size(0), x.size(1)}).contiguous();
    return second(first(x), positions);
  }
  models::LlamaBlock first{nullptr}, second{nullptr};
};

/// A named factory of one class.
struct ModuleClass {
  std::string name;
  std::function<std::shared_ptr<CaseModule>(int64_t dim)> make;
};

/// The classes the split supports exactly (rejected ones have their own tests).
inline std::vector<ModuleClass> supported_module_classes() {
  return {
      {"RegisteredTwice", [](int64_t d) { return std::make_shared<RegisteredTwice>(d); }},
      {"Frozen", [](int64_t d) { return std::make_shared<Frozen>(d); }},
      {"ParameterOnlyInput", [](int64_t d) { return std::make_shared<ParameterOnlyInput>(d); }},
      {"Hooked", [](int64_t d) { return std::make_shared<Hooked>(d); }},
      {"InPlaceViews", [](int64_t d) { return std::make_shared<InPlaceViews>(d); }},
      {"InPlaceViewWithParameter", [](int64_t d) { return std::make_shared<InPlaceViewWithParameter>(d); }},
      {"UnregisteredLeaves", [](int64_t d) { return std::make_shared<UnregisteredLeaves>(d); }},
      {"Dropped", [](int64_t d) { return std::make_shared<Dropped>(d); }},
      {"TorchZoo", [](int64_t d) { return std::make_shared<TorchZoo>(d); }},
      {"SharedAcrossPaths", [](int64_t d) { return std::make_shared<SharedAcrossPaths>(d); }},
      {"FastHooked", [](int64_t d) { return std::make_shared<FastHooked>(d); }},
      {"StageDropout", [](int64_t d) { return std::make_shared<StageDropout>(d); }},
      {"Normalized", [](int64_t d) { return std::make_shared<Normalized>(d); }},
      {"Routed", [](int64_t d) { return std::make_shared<Routed>(d); }},
      {"CustomFunction", [](int64_t d) { return std::make_shared<CustomFunction>(d); }},
      {"NonContiguousParameter", [](int64_t d) { return std::make_shared<NonContiguousParameter>(d); }},
      {"LlamaBlocks", [](int64_t d) { return std::make_shared<LlamaBlocks>(d); }},
  };
}

/// A gradient hook on a fast-path parameter: fast layers cannot run it (rejected in both modes).
struct FastParameterHook : CaseModule {
  explicit FastParameterHook(int64_t dim) {
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    fast->weight.register_hook([](const torch::Tensor& g) { return g * 2.0; });
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fast(x) + x; }
  twobp::nn::Linear fast{nullptr};
};

/// Every parameter's .grad (defined vs undefined, then values), every buffer, and the extras of `got` against
/// `ref`, to `tol` relative to max(1, |ref|). Returns a description of the first mismatch, empty when equal.
inline std::string compare_modules(CaseModule& got, CaseModule& ref, double tol) {
  auto close = [&](torch::Tensor a, torch::Tensor b, const std::string& what) -> std::string {
    if (a.defined() != b.defined()) {
      return what + (b.defined() ? " is undefined, reference has a value" : " is defined, reference has none");
    }
    if (!a.defined()) return "";
    if (a.is_sparse() != b.is_sparse()) return what + ": sparse layout differs from the reference's";
    if (a.is_sparse()) {
      a = a.to_dense();
      b = b.to_dense();
    }
    if (a.sizes() != b.sizes()) return what + ": shape differs";
    const double err = (a - b).abs().max().item<double>();
    const double scale = std::max(1.0, b.abs().max().item<double>());
    return err / scale <= tol ? "" : what + ": max abs error " + std::to_string(err);
  };
  auto ref_params = ref.named_parameters();
  auto got_params = got.named_parameters();
  if (ref_params.size() != got_params.size()) return "parameter lists differ";
  for (const auto& item : ref_params) {
    auto r = close(got_params[item.key()].grad(), item.value().grad(), "grad of " + item.key());
    if (!r.empty()) return r;
  }
  auto ref_buffers = ref.named_buffers();
  auto got_buffers = got.named_buffers();
  for (const auto& item : ref_buffers) {
    auto r = close(got_buffers[item.key()], item.value(), "buffer " + item.key());
    if (!r.empty()) return r;
  }
  auto re = ref.extras(), ge = got.extras();
  if (re.size() != ge.size()) return "extras differ in number";
  for (std::size_t i = 0; i < re.size(); ++i) {
    auto r = close(ge[i], re[i], "extra " + std::to_string(i));
    if (!r.empty()) return r;
  }
  return "";
}

}  // namespace twobp::testing
