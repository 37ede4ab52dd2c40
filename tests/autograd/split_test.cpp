// Parity of the 2BP split against ordinary backprop (loss.backward()) on one stage, for both paths.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <random>

#include "common/expect_error.h"
#include "common/test_models.h"
#include "twobp/error.h"
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

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return (out - target).pow(2).mean(); }

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
