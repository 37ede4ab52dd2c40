// Parity of the 2BP split against ordinary backprop (loss.backward()) on one stage, for both paths; and the CUDA
// kernels its GPU paths need, registered by the linked LibTorch.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <functional>
#include <map>
#include <random>

#include "common/expect_error.h"
#include "common/test_models.h"
#include "twobp/autograd/weight_grad_store.h"
#include "twobp/error.h"
#include "twobp/metrics/op_count.h"
#include "twobp/models/llama.h"
#include "twobp/stage.h"

namespace twobp::testing {
namespace {

enum class Mode { kFused, kSplitInOrder, kSplitReversedW, kSplitBatchedW, kSplitInterleaved, kSplitUnbatched };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kFused: return "fused";
    case Mode::kSplitInOrder: return "split-in-order";
    case Mode::kSplitReversedW: return "split-reversed-W";
    case Mode::kSplitBatchedW: return "split-batched-W";
    case Mode::kSplitInterleaved: return "split-interleaved";
    case Mode::kSplitUnbatched: return "split-unbatched";
  }
  return "?";
}

const Mode kAllModes[] = {Mode::kFused,          Mode::kSplitInOrder,      Mode::kSplitReversedW,
                          Mode::kSplitBatchedW,  Mode::kSplitInterleaved,  Mode::kSplitUnbatched};

struct Case {
  std::function<std::shared_ptr<torch::nn::Module>()> make;         // seeded by the harness
  std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&)> forward;
  std::function<torch::Tensor(int)> input;
  std::function<torch::Tensor(int)> target;
  LossFunction loss;
  int stage_index = 1;
  int micro_batches = 3;
};

void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) return;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double err = (a - b).abs().max().item<double>();
  const double ref = std::max(1.0, b.abs().max().item<double>());
  EXPECT_LE(err / ref, 1e-10) << what << ": max abs error " << err;
}

void run_case(const Case& c, Mode mode) {
  SCOPED_TRACE(mode_name(mode));
  const double scale = 1.0 / c.micro_batches;
  torch::manual_seed(7);
  auto reference = c.make();
  torch::manual_seed(7);
  auto candidate = c.make();

  // Reference: ordinary LibTorch backprop, micro-batch by micro-batch.
  std::vector<torch::Tensor> ref_losses, ref_input_grads;
  for (int mb = 0; mb < c.micro_batches; ++mb) {
    torch::Tensor x = c.input(mb);
    if (c.stage_index > 0) x = x.detach().requires_grad_(true);
    auto loss = c.loss(c.forward(*reference, x), c.target(mb));
    (loss * scale).backward();
    ref_losses.push_back(loss.detach());
    ref_input_grads.push_back(c.stage_index > 0 ? x.grad() : torch::Tensor());
  }

  StageOptions options;
  options.stage_index = c.stage_index;
  options.num_stages = c.stage_index + 1;
  options.loss = c.loss;
  options.loss_scale = scale;
  options.batch_weight_grads = mode != Mode::kSplitUnbatched;
  auto* raw = candidate.get();
  Stage stage(candidate, [&c, raw](const at::Tensor& x) { return c.forward(*raw, x); }, options);

  std::vector<torch::Tensor> losses(c.micro_batches), input_grads(c.micro_batches);
  std::vector<int> all;
  for (int mb = 0; mb < c.micro_batches; ++mb) all.push_back(mb);

  if (mode == Mode::kSplitInterleaved) {
    // F0 I0 F1 I1 W0 F2 I2 W2 W1: W interleaved with later forwards, out of order.
    for (int mb = 0; mb < c.micro_batches; ++mb) {
      losses[mb] = stage.forward(mb, c.input(mb), c.target(mb));
      input_grads[mb] = stage.backward_input(mb);
      if (mb == 0) stage.backward_weight({0});
    }
    std::vector<int> rest(all.rbegin(), all.rend() - 1);
    for (int mb : rest) stage.backward_weight({mb});
  } else {
    for (int mb = 0; mb < c.micro_batches; ++mb) losses[mb] = stage.forward(mb, c.input(mb), c.target(mb));
    for (int mb = 0; mb < c.micro_batches; ++mb) {
      input_grads[mb] = mode == Mode::kFused ? stage.backward(mb) : stage.backward_input(mb);
    }
    if (mode != Mode::kFused) {
      // Stage 1 alone must not have touched any parameter gradient.
      for (const auto& p : candidate->parameters()) EXPECT_FALSE(p.grad().defined()) << "grad written before W";
    }
    if (mode == Mode::kSplitInOrder || mode == Mode::kSplitUnbatched) {
      for (int mb : all) stage.backward_weight({mb});
    } else if (mode == Mode::kSplitReversedW) {
      for (auto it = all.rbegin(); it != all.rend(); ++it) stage.backward_weight({*it});
    } else if (mode == Mode::kSplitBatchedW) {
      std::vector<int> shuffled = all;
      std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));
      stage.backward_weight(shuffled);
    }
  }
  EXPECT_EQ(stage.live_micro_batches(), 0u);
  EXPECT_EQ(stage.weight_grad_store().pending_bytes(), 0);

  for (int mb = 0; mb < c.micro_batches; ++mb) {
    expect_close(losses[mb], ref_losses[mb], "loss of micro-batch " + std::to_string(mb));
    expect_close(input_grads[mb], ref_input_grads[mb], "input gradient of micro-batch " + std::to_string(mb));
  }
  auto ref_params = reference->named_parameters();
  auto cand_params = candidate->named_parameters();
  ASSERT_EQ(ref_params.size(), cand_params.size());
  for (const auto& item : ref_params) {
    const auto& p = cand_params[item.key()];
    ASSERT_TRUE(p.grad().defined()) << item.key() << " got no gradient";
    expect_close(p.grad(), item.value().grad(), "gradient of " + item.key());
  }
}

class SplitParity : public ::testing::TestWithParam<Mode> {
 protected:
  Float64Default float64_;
};

template <typename Holder, typename... Args>
std::function<std::shared_ptr<torch::nn::Module>()> maker(Args... args) {
  return [=] { return std::static_pointer_cast<torch::nn::Module>(Holder(args...).ptr()); };
}

template <typename Impl>
std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&)> forwarder() {
  return [](torch::nn::Module& m, const torch::Tensor& x) { return static_cast<Impl&>(m).forward(x); };
}

std::function<torch::Tensor(int)> randn_input(std::vector<int64_t> shape, int seed) {
  return [=](int mb) { return torch::randn(shape, torch::Generator(at::detail::createCPUGenerator(seed * 100 + mb))); };
}

TEST_P(SplitParity, FastPathMlp) {
  run_case({maker<FastMlp>(6), forwarder<FastMlpImpl>(), randn_input({4, 6}, 1), randn_input({4, 6}, 2), mse},
           GetParam());
}

TEST_P(SplitParity, GeneralPathMlp) {
  run_case({maker<TorchMlp>(6), forwarder<TorchMlpImpl>(), randn_input({4, 6}, 1), randn_input({4, 6}, 2), mse},
           GetParam());
}

TEST_P(SplitParity, GeneralPathBiasedLinearOn3dInput) {
  // Regression: the view in front of a biased Linear on [batch, seq, dim] input is referenced only by the frontier
  // node's input edge, which stage 1 cuts; the split must not touch it after that.
  run_case({maker<TorchMlp>(6), forwarder<TorchMlpImpl>(), randn_input({2, 3, 6}, 12), randn_input({2, 3, 6}, 13),
            mse},
           GetParam());
}

TEST_P(SplitParity, LlamaBlock) {
  run_case({maker<TinyBlock>(16, 4, 2, 24), forwarder<TinyBlockImpl>(), randn_input({2, 5, 16}, 3),
            randn_input({2, 5, 16}, 4), mse},
           GetParam());
}

TEST_P(SplitParity, ConvBatchNorm) {
  run_case({maker<ConvNet>(3), forwarder<ConvNetImpl>(), randn_input({2, 3, 6, 6}, 5), randn_input({2, 3, 6, 6}, 6),
            mse},
           GetParam());
}

TEST_P(SplitParity, ConvBatchNormFirstStage) {
  // Stage 0: the image needs no gradient, so stage 1 has nothing to do and W runs the whole general backward.
  Case c{maker<ConvNet>(3), forwarder<ConvNetImpl>(), randn_input({2, 3, 6, 6}, 5), randn_input({2, 3, 6, 6}, 6),
         mse};
  c.stage_index = 0;
  run_case(c, GetParam());
}

TEST_P(SplitParity, EmbeddingRepeatedIdsTiedHead) {
  Case c;
  c.make = maker<TiedLm>(11, 8);
  c.forward = forwarder<TiedLmImpl>();
  // Few distinct ids in many positions: repeated rows must accumulate.
  c.input = [](int mb) { return torch::tensor({{1, 3, 3, 1, 7}, {3, 3, 3, 0, 1}}, torch::kLong) + mb % 2; };
  c.target = [](int mb) { return torch::tensor({{2, 3, 4, 5, 6}, {1, 1, 1, 2, 2}}, torch::kLong) + mb; };
  c.loss = [](const torch::Tensor& logits, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
  };
  c.stage_index = 0;
  run_case(c, GetParam());
}

TEST_P(SplitParity, ModuleWithBuffersAndReusedParameter) {
  run_case({maker<Buffered>(5), forwarder<BufferedImpl>(), randn_input({3, 5}, 8), randn_input({3, 5}, 9), mse},
           GetParam());
}

INSTANTIATE_TEST_SUITE_P(Modes, SplitParity, ::testing::ValuesIn(kAllModes),
                         [](const auto& info) {
                           std::string n = mode_name(info.param);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// A custom op whose backward records which gradients autograd asked for: proves that stage 1 computes only the
// input gradient and stage 2 only the weight gradient (no work is done twice).
struct Calls {
  std::vector<std::pair<bool, bool>> asked;  // (input grad, weight grad)
};
Calls* g_calls = nullptr;

struct ScaleOp : torch::autograd::Function<ScaleOp> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto saved = ctx->get_saved_variables();
    const bool gx = ctx->needs_input_grad(0), gw = ctx->needs_input_grad(1);
    if (g_calls) g_calls->asked.emplace_back(gx, gw);
    return {gx ? g[0] * saved[1] : torch::Tensor(), gw ? (g[0] * saved[0]).sum(0) : torch::Tensor()};
  }
};

struct ScaleModule : torch::nn::Module {
  ScaleModule() { w = register_parameter("w", torch::randn({4})); }
  torch::Tensor forward(const torch::Tensor& x) { return ScaleOp::apply(x, w); }
  torch::Tensor w;
};

TEST(SplitGeneralPath, EachStageComputesOnlyItsOwnGradients) {
  Calls calls;
  g_calls = &calls;
  auto module = std::make_shared<ScaleModule>();
  StageOptions options;
  options.stage_index = 1;
  options.loss = mse;
  Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, options);
  stage.forward(0, torch::randn({3, 4}), torch::randn({3, 4}));
  stage.backward_input(0);
  ASSERT_EQ(calls.asked.size(), 1u);
  EXPECT_EQ(calls.asked[0], std::make_pair(true, false)) << "stage 1 must ask for the input gradient only";
  EXPECT_FALSE(module->w.grad().defined());
  stage.backward_weight({0});
  ASSERT_EQ(calls.asked.size(), 2u);
  EXPECT_EQ(calls.asked[1], std::make_pair(false, true)) << "stage 2 must ask for the weight gradient only";
  EXPECT_TRUE(module->w.grad().defined());
  g_calls = nullptr;
}

class StageMisuse : public ::testing::Test {
 protected:
  StageMisuse() : mlp(6) {
    options.stage_index = 2;
    options.rank = 1;
    options.loss = mse;
    stage = std::make_unique<Stage>(mlp.ptr(), [this](const at::Tensor& x) { return mlp->forward(x); }, options);
  }
  void expect_usage_error(const std::function<void()>& f, const std::vector<std::string>& words) {
    expect_error<UsageError>(f, words);
  }
  FastMlp mlp;
  StageOptions options;
  std::unique_ptr<Stage> stage;
};

TEST_F(StageMisuse, WeightBeforeInput) {
  stage->forward(3, torch::randn({2, 6}), torch::randn({2, 6}));
  expect_usage_error([&] { stage->backward_weight({3}); }, {"rank 1", "stage 2", "micro-batch 3", "before I"});
}

TEST_F(StageMisuse, InputTwice) {
  stage->forward(1, torch::randn({2, 6}), torch::randn({2, 6}));
  stage->backward_input(1);
  expect_usage_error([&] { stage->backward_input(1); }, {"micro-batch 1", "twice"});
  expect_usage_error([&] { stage->backward(1); }, {"micro-batch 1", "after I"});
}

TEST_F(StageMisuse, UnknownMicroBatch) {
  expect_usage_error([&] { stage->backward_input(4); }, {"micro-batch 4", "no pending forward"});
  expect_usage_error([&] { stage->backward_weight({5}); }, {"micro-batch 5"});
}

TEST_F(StageMisuse, ForwardTwice) {
  stage->forward(0, torch::randn({2, 6}), torch::randn({2, 6}));
  expect_usage_error([&] { stage->forward(0, torch::randn({2, 6}), torch::randn({2, 6})); },
                     {"micro-batch 0", "F called again"});
}

TEST_F(StageMisuse, GradientOfWrongShapeOrDtype) {
  StageOptions mid = options;
  mid.loss = nullptr;
  Stage middle(mlp.ptr(), [this](const at::Tensor& x) { return mlp->forward(x); }, mid);
  middle.forward(2, torch::randn({2, 6}));
  expect_usage_error([&] { middle.backward_input(2, torch::randn({3, 6})); }, {"micro-batch 2", "[3, 6]", "[2, 6]"});
  expect_usage_error([&] { middle.backward_input(2, torch::randn({2, 6}, torch::kDouble)); },
                     {"micro-batch 2", "Double", "Float"});
  expect_usage_error([&] { middle.backward_input(2); }, {"micro-batch 2", "gradients of the outputs"});
  // The stage is unchanged by the rejected calls: a correct gradient still works.
  EXPECT_EQ(middle.backward_input(2, torch::randn({2, 6})).sizes(), torch::IntArrayRef({2, 6}));
}

TEST(FastPathLayers, OutsideAStageTheyAreOrdinaryOps) {
  torch::manual_seed(0);
  twobp::nn::Linear fast(5, 3);
  torch::nn::Linear ref(5, 3);
  ref->weight.data().copy_(fast->weight.data());
  ref->bias.data().copy_(fast->bias.data());
  auto x = torch::randn({4, 5});
  fast(x).sum().backward();
  ref(x).sum().backward();
  EXPECT_TRUE(torch::allclose(fast->weight.grad(), ref->weight.grad()));
  EXPECT_TRUE(torch::allclose(fast->bias.grad(), ref->bias.grad()));
}

TEST(FastPathLayers, WeightModifiedBetweenForwardAndBackwardIsAnError) {
  FastMlp mlp(4);
  StageOptions options;
  options.stage_index = 1;
  options.loss = mse;
  Stage stage(mlp.ptr(), [&](const at::Tensor& x) { return mlp->forward(x); }, options);
  stage.forward(0, torch::randn({2, 4}), torch::randn({2, 4}));
  {
    torch::NoGradGuard no_grad;
    mlp->fc2->weight.add_(1.0);
  }
  EXPECT_THROW(stage.backward_input(0), std::exception);
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

TEST(WeightGradBatching, ConcatenatedAndSeparateGemmsGiveTheSameGradients) {
  torch::manual_seed(11);
  auto weight = torch::randn({5, 3}, torch::kDouble).requires_grad_(true);
  auto bias = torch::randn({5}, torch::kDouble).requires_grad_(true);
  std::vector<autograd::WeightGradItem> items;
  // A different sequence length per micro-batch (variable shapes at stage boundaries): rows are concatenated.
  for (int k = 0; k < 3; ++k) {
    items.push_back({torch::randn({2, 2 + k, 3}, torch::kDouble), torch::randn({2, 2 + k, 5}, torch::kDouble)});
  }
  std::vector<torch::Tensor> grads;
  for (auto batching : {nn::functional::Batching::kConcatenate, nn::functional::Batching::kSeparate}) {
    weight.mutable_grad().reset();
    bias.mutable_grad().reset();
    nn::functional::linear_weight_grad(weight, bias, items, batching);
    grads.push_back(weight.grad().clone());
    grads.push_back(bias.grad().clone());
  }
  torch::Tensor expected_w = torch::zeros({5, 3}, torch::kDouble), expected_b = torch::zeros({5}, torch::kDouble);
  for (const auto& item : items) {
    expected_w += item.grad_output.reshape({-1, 5}).t().mm(item.input.reshape({-1, 3}));
    expected_b += item.grad_output.reshape({-1, 5}).sum(0);
  }
  EXPECT_TRUE(torch::allclose(grads[0], expected_w)) << "concatenated";
  EXPECT_TRUE(torch::allclose(grads[2], expected_w)) << "separate";
  EXPECT_TRUE(torch::allclose(grads[1], expected_b));
  EXPECT_TRUE(torch::allclose(grads[3], expected_b));
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

/// A stage of fast layers (one weight tied between the first and the last), a general layer, and a fast weight
/// the general path uses as well.
struct DoneModule : torch::nn::Module {
  DoneModule() {
    a = register_module("a", twobp::nn::Linear(4, 4));
    b = register_module("b", twobp::nn::Linear(4, 4));
    c = register_module("c", twobp::nn::Linear(4, 4));
    general = register_module("general", torch::nn::Linear(4, 4));
    shared = register_module("shared", twobp::nn::Linear(4, 4));
    c->tie_weight(a->weight);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(a(x));
    h = torch::tanh(b(h));
    h = general(h) + shared(h) * shared->bias.sum();  // shared's bias: fast path and general path
    return c(h);
  }
  twobp::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, shared{nullptr};
  torch::nn::Linear general{nullptr};
};

// W reports a parameter when no later part of the W writes it: at that moment its .grad already holds its
// final value for the W. Tied and general-path tensors are reported late or not at all, never early.
TEST(WeightGradDone, ReportsEachFastParameterOnceWhenItsGradientIsFinal) {
  Float64Default f;
  for (bool batched : {true, false}) {
    SCOPED_TRACE(batched ? "batched" : "separate");
    torch::manual_seed(3);
    auto module = std::make_shared<DoneModule>();
    StageOptions so;
    so.stage_index = 1;
    so.num_stages = 3;
    so.batch_weight_grads = batched;
    Stage stage(module, [m = module.get()](const at::Tensor& x) { return m->forward(x); }, so);
    for (int mb = 0; mb < 2; ++mb) {
      at::Tensor out = stage.forward(mb, torch::randn({3, 4}));
      stage.backward_input(mb, torch::randn({3, 4}));
    }
    std::map<const c10::TensorImpl*, at::Tensor> seen;  // grad snapshot at report time
    std::vector<std::string> order;
    auto names = module->named_parameters();
    stage.backward_weight({0, 1}, [&](const std::vector<at::Tensor>& params) {
      for (const auto& p : params) {
        EXPECT_TRUE(seen.emplace(p.unsafeGetTensorImpl(), p.grad().clone()).second) << "reported twice";
        for (const auto& item : names) {
          if (item.value().is_same(p)) order.push_back(item.key());
        }
      }
    });
    // Every fast-only parameter was reported, with its final gradient; the general-path ones and shared.bias
    // (written by both paths) were not.
    for (const auto& name : {"a.weight", "a.bias", "b.weight", "b.bias", "c.bias", "shared.weight"}) {
      const at::Tensor& p = names[name];
      auto it = seen.find(p.unsafeGetTensorImpl());
      ASSERT_NE(it, seen.end()) << name << " not reported";
      EXPECT_TRUE(at::equal(it->second, p.grad())) << name << " was reported before its gradient was final";
    }
    for (const auto& name : {"general.weight", "general.bias", "shared.bias"}) {
      EXPECT_EQ(seen.count(names[name].unsafeGetTensorImpl()), 0u) << name << " reported by the fast path";
    }
    // The tied weight is written by c's and a's kernels: reported after both, i.e. after b (queued between).
    const auto pos = [&](const std::string& n) { return std::find(order.begin(), order.end(), n) - order.begin(); };
    EXPECT_GT(pos("a.weight"), pos("b.weight"));
  }
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

// The rotary node against the composite formula (test_models.h), forward and backward, float64; the tables of
// given positions against those of 0..seq-1 gathered by hand.
TEST(RotaryEmbedding, OneNodeEqualsTheCompositeFormula) {
  Float64Default f;
  torch::manual_seed(5);
  const twobp::nn::RotaryEmbedding rotary(8, 10000.0, 16);
  const auto x = torch::randn({2, 3, 6, 8}), r = torch::randn({2, 3, 6, 8});
  auto a = x.clone().requires_grad_(true), b = x.clone().requires_grad_(true);
  const auto got = rotary(a), want = apply_rotary(b);
  EXPECT_LE((got - want).abs().max().item<double>(), 1e-5) << "angles in float32, as the model computes them";
  // The gradient is the transposed rotation of the same tables: exact against autograd through the node's ops.
  const auto tables = rotary.tables(x);
  const auto composite = x.clone().requires_grad_(true);
  const auto rolled = composite * tables.cos + composite.roll(4, -1) * tables.sin_signed;
  (got * r).sum().backward();
  (rolled * r).sum().backward();
  EXPECT_LE((a.grad() - composite.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LE((rolled - got).abs().max().item<double>(), 1e-12);
  (want * r).sum().backward();
  EXPECT_LE((a.grad() - b.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_FALSE(tables.cos.requires_grad());

  const auto positions = torch::tensor({{0, 1, 2, 0, 1, 5}, {3, 2, 1, 0, 0, 0}}, torch::kLong);
  const auto gathered = rotary.tables(x, positions);
  ASSERT_EQ(gathered.cos.sizes(), torch::IntArrayRef({2, 1, 6, 8}));
  const auto full = rotary.tables(torch::zeros({1, 1, 16, 8}));
  for (int64_t bi = 0; bi < 2; ++bi) {
    for (int64_t s = 0; s < 6; ++s) {
      const int64_t p = positions[bi][s].item<int64_t>();
      EXPECT_TRUE(torch::equal(gathered.cos[bi][0][s], full.cos[p])) << bi << "," << s;
      EXPECT_TRUE(torch::equal(gathered.sin_signed[bi][0][s], full.sin_signed[p])) << bi << "," << s;
    }
  }
}

struct FreeLeafModule : torch::nn::Module {
  FreeLeafModule() : free_leaf(torch::randn({4}).requires_grad_(true)) {
    fc = register_module("fc", twobp::nn::Linear(4, 4));
    norm = register_module("norm", twobp::nn::RMSNorm(4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return norm(fc(x) * free_leaf); }
  torch::Tensor free_leaf;  // trainable, not registered
  twobp::nn::Linear fc{nullptr};
  twobp::nn::RMSNorm norm{nullptr};
};

// A stage whose parameters are all fast-path: I is the one engine run B makes (a trainable leaf the module does
// not register gets its exact gradient there), the weights wait for W. Once the fast weight is used through
// ordinary ops too, I analyses the graph again and that gradient waits for W as well.
TEST(FastOnlyStage, InputBackwardRunsWithoutTheGraphAnalysis) {
  Float64Default f;
  for (bool ordinary_use : {false, true}) {
    SCOPED_TRACE(ordinary_use ? "fast weight also used by ordinary ops" : "fast layers only");
    torch::manual_seed(2);
    auto module = std::make_shared<FreeLeafModule>();
    torch::manual_seed(2);
    auto reference = std::make_shared<FreeLeafModule>();
    auto forward = [ordinary_use](FreeLeafModule& m, const torch::Tensor& x) {
      auto y = m.forward(x);
      return ordinary_use ? y + torch::matmul(x, m.fc->weight.t()) : y;
    };
    StageOptions so;
    so.stage_index = 1;
    so.num_stages = 3;
    Stage stage(module, [&, raw = module.get()](const at::Tensor& x) { return forward(*raw, x); }, so);
    const auto x = torch::randn({3, 4}), dy = torch::randn({3, 4});
    stage.forward(0, x);
    const auto dx = stage.backward_input(0, dy);
    EXPECT_FALSE(module->fc->weight.grad().defined());
    EXPECT_FALSE(module->norm->weight.grad().defined());
    // Fast-only: the unregistered leaf's gradient comes with I's engine run; analysed: it is W's work.
    EXPECT_EQ(module->free_leaf.grad().defined(), !ordinary_use);
    stage.backward_weight({0});
    auto xr = x.clone().requires_grad_(true);
    forward(*reference, xr).backward(dy);
    EXPECT_LE((dx - xr.grad()).abs().max().item<double>(), 1e-12);
    for (const auto& [name, p] : std::vector<std::pair<std::string, torch::Tensor>>{
             {"fc.weight", module->fc->weight}, {"fc.bias", module->fc->bias}, {"norm.weight", module->norm->weight},
             {"free", module->free_leaf}}) {
      const torch::Tensor ref = name == "free" ? reference->free_leaf : reference->named_parameters()[name];
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_LE((p.grad() - ref.grad()).abs().max().item<double>(), 1e-12) << name;
    }
  }
}

// W adds into .grad inside the GEMM (addmm_ with beta = 1): the same values as a product added afterwards; a
// bfloat16 parameter with a float32 master (mixed precision) gets nothing in its own .grad.
TEST(AccumulateMatmul, AddsIntoTheGradientOrItsMaster) {
  Float64Default f;
  torch::manual_seed(4);
  auto w = torch::zeros({5, 3}).requires_grad_(true);
  const auto a = torch::randn({5, 7}), b = torch::randn({7, 3}), c = torch::randn({5, 7}), d = torch::randn({7, 3});
  autograd::accumulate_matmul(w, a, b);
  EXPECT_TRUE(torch::equal(w.grad(), a.mm(b)));
  const auto before = w.grad().data_ptr();
  autograd::accumulate_matmul(w, c, d);
  EXPECT_EQ(w.grad().data_ptr(), before) << "accumulated in place";
  EXPECT_LE((w.grad() - (a.mm(b) + c.mm(d))).abs().max().item<double>(), 1e-12);

  auto compute = torch::zeros({5, 3}, torch::kBFloat16).requires_grad_(true);
  auto master = torch::zeros({5, 3}, torch::kFloat).requires_grad_(true);
  autograd::set_master_gradient(compute, master);
  EXPECT_TRUE(autograd::gradient_holder(compute).is_same(master));
  const auto ab = a.to(torch::kBFloat16), bb = b.to(torch::kBFloat16);
  autograd::accumulate_matmul(compute, ab, bb);
  autograd::accumulate_matmul(compute, ab, bb);
  EXPECT_FALSE(compute.grad().defined());
  ASSERT_EQ(master.grad().scalar_type(), torch::kFloat);
  // On the CPU the bfloat16 product is rounded once, then added in float32.
  EXPECT_TRUE(torch::equal(master.grad(), 2 * ab.mm(bb).to(torch::kFloat)));
  // What autograd accumulates into the compute parameter moves to the master too.
  (compute * 1.0).sum().backward();
  EXPECT_FALSE(compute.grad().defined());
  EXPECT_TRUE(torch::equal(master.grad(), 2 * ab.mm(bb).to(torch::kFloat) + 1));
  EXPECT_THROW(autograd::set_master_gradient(compute, master), UsageError) << "one slot per tensor";
}

// The CUDA-only operators the split's GPU paths call (split_cuda_test runs them on a GPU): fused RMSNorm and its
// backward, and the float32-output GEMMs of W under mixed precision (accumulate_matmul). The linked LibTorch must
// register a CUDA kernel for each, so that an upgrade that drops or renames one fails here, on the CPU, and not
// first on a lent GPU. The dispatcher knows without a GPU: libtorch_cuda registers its kernels when it loads.
TEST(CudaKernels, LinkedLibTorchRegistersTheSplitsCudaOnlyOperators) {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    GTEST_SKIP() << "this build links no CUDA library of LibTorch (a CPU-only LibTorch, or the CPU-only import "
                    "TWOBP_TORCH_CPU_ONLY): there are no CUDA kernels to look for";
  }
  const std::pair<const char*, const char*> ops[] = {{"aten::_fused_rms_norm", ""},
                                                     {"aten::_fused_rms_norm_backward", ""},
                                                     {"aten::mm", "dtype"},
                                                     {"aten::baddbmm", "dtype_out"}};
  for (const auto& [name, overload] : ops) {
    const std::string op = std::string(name) + (*overload ? std::string(".") + overload : "");
    const auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
    ASSERT_TRUE(handle.has_value()) << op << ": no such operator in this LibTorch " << TORCH_VERSION;
    EXPECT_TRUE(handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA))
        << op << ": no CUDA kernel in this LibTorch " << TORCH_VERSION;
  }
}

// Top-level operators per phase of a Stage on the library's LLaMa chunk of `blocks` blocks, F I W then F B,
// accumulating into existing gradients (deterministic on the CPU).
std::map<std::string, int64_t> count_phases(int blocks) {
  torch::manual_seed(6);
  const models::LlamaConfig c = models::config_by_name("tiny");
  auto chunk = models::LlamaChunk(c, models::ChunkSpec{0, blocks, false, false});
  StageOptions so;
  so.stage_index = 1;
  so.num_stages = 3;
  Stage stage(chunk.ptr(), [raw = chunk.ptr()](const at::Tensor& x) { return raw->forward(x); }, so);
  const auto x = torch::randn({1, 8, c.dim}), dy = torch::randn({1, 8, c.dim});
  for (const auto& p : chunk->parameters()) p.mutable_grad() = torch::zeros_like(p);
  std::map<std::string, int64_t> ops;
  metrics::AtenOpCounter counter;
  auto count = [&](const std::string& phase, const std::function<void()>& fn) {
    counter.take();
    fn();
    ops[phase] = counter.take().ops;
  };
  count("F", [&] { stage.forward(0, x); });
  count("I", [&] { stage.backward_input(0, dy); });
  count("W", [&] { stage.backward_weight({0}); });
  stage.forward(1, x);
  count("B", [&] { stage.backward(1, dy); });
  return ops;
}

// The split's promise at the operator level, per block (two chunks' difference): I and W together launch at most
// 2 more top-level operators than B, and I no more than it must (the rotary node: 3 operators per use).
TEST(OperatorCount, InputAndWeightLaunchAtMostTwoMorePerBlockThanFused) {
  const auto one = count_phases(1), two = count_phases(2);
  std::map<std::string, int64_t> per_block;
  for (const auto& [phase, n] : two) per_block[phase] = n - one.at(phase);
  const std::string counts = "per block: F " + std::to_string(per_block["F"]) + " I " + std::to_string(per_block["I"]) +
                             " W " + std::to_string(per_block["W"]) + " B " + std::to_string(per_block["B"]);
  EXPECT_LE(per_block["I"] + per_block["W"], per_block["B"] + 2) << counts;
  EXPECT_GT(per_block["W"], 0) << counts;
  // Measured 2026-12-06: F 49 I 49 W 38 B 87 (grouped-query attention adds repeat_interleave). The composite
  // rotary formula cost I about 18 more per block (twobp_bench split's stack: 66 before, 42 after).
  EXPECT_LE(per_block["I"], 49) << counts;
}

}  // namespace
}  // namespace twobp::testing
