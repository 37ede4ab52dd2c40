// Classes of modules through the Stage API: every parameter's .grad (defined vs undefined, then values), every
// buffer and each class's extras equal loss.backward()'s, float64, over two steps without zero_grad, with a
// different sequence length per micro-batch, in fused mode and in every order of 2BP's I and W. Cases the split
// cannot run exactly are rejected on the first micro-batch with a UsageError that says what to do instead.

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <utility>

#include "common/expect_error.h"
#include "common/split_cases.h"
#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/random.h"
#include "twobp/stage.h"

namespace twobp::testing {
namespace {

constexpr int64_t kDim = 4;
constexpr int kMicroBatches = 3;
constexpr int kSteps = 2;

enum class BackwardVariant { kFused, kSplitInOrder, kSplitBatchedShuffled, kSplitInterleaved };
const BackwardVariant kBackwardVariants[] = {BackwardVariant::kFused, BackwardVariant::kSplitInOrder,
                                            BackwardVariant::kSplitBatchedShuffled,
                                            BackwardVariant::kSplitInterleaved};

std::string variant_name(BackwardVariant m) {
  switch (m) {
    case BackwardVariant::kFused: return "fused";
    case BackwardVariant::kSplitInOrder: return "split_in_order";
    case BackwardVariant::kSplitBatchedShuffled: return "split_batched_shuffled";
    case BackwardVariant::kSplitInterleaved: return "split_interleaved";
  }
  return "?";
}

torch::Generator seeded(int seed) { return torch::Generator(at::detail::createCPUGenerator(seed)); }

// Micro-batch mb has sequence length 2 + mb: batched W must cope with items of different shapes.
torch::Tensor activation(int mb, int seed) { return torch::randn({2, 2 + mb, kDim}, seeded(seed * 100 + mb)); }

struct Inputs {
  std::function<torch::Tensor(int mb)> input = [](int mb) { return activation(mb, 1); };
  std::function<torch::Tensor(int mb)> target = [](int mb) { return activation(mb, 2); };
  int stage_index = 1;
  bool recompute = false;  // StageOptions::recompute: F keeps only the input, I/B re-run the forward
};

// Two modules built alike (from seed 7): the reference that loss.backward() trains and the candidate a Stage does.
template <class Make>
auto twin_modules(const Make& make) {
  torch::manual_seed(7);
  auto reference = make();
  torch::manual_seed(7);
  return std::make_pair(reference, make());
}

// Runs kSteps steps of kMicroBatches through a Stage in `mode` and through loss.backward() on a twin module, then
// compares everything. Any exception of the Stage propagates (rejection tests catch it).
void run_class(const std::function<std::shared_ptr<CaseModule>()>& make, BackwardVariant mode, const Inputs& in = {}) {
  SCOPED_TRACE(variant_name(mode) + (in.recompute ? " with recomputation" : ""));
  const double scale = 1.0 / kMicroBatches;
  auto twins = twin_modules(make);
  auto reference = twins.first, candidate = twins.second;

  StageOptions options;
  options.stage_index = in.stage_index;
  options.num_stages = in.stage_index + 1;
  options.rank = 0;
  options.loss = mse;
  options.loss_scale = scale;
  options.recompute = in.recompute;
  auto* raw = candidate.get();
  Stage stage(candidate, [raw](const at::Tensor& x) { return raw->forward(x); }, options);

  for (int step = 0; step < kSteps; ++step) {
    std::vector<torch::Tensor> ref_losses, ref_input_grads;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      torch::Tensor x = in.input(mb);
      if (in.stage_index > 0) x = x.detach().requires_grad_(true);
      torch::Tensor out;
      {
        StageRandomScope random(/*seed=*/0, in.stage_index, mb, /*pass=*/step);  // as the Stage's forward
        out = reference->forward(x);
      }
      auto loss = mse(out, in.target(mb));
      (loss * scale).backward();
      ref_losses.push_back(loss.detach());
      ref_input_grads.push_back(in.stage_index > 0 ? x.grad() : torch::Tensor());
    }

    std::vector<torch::Tensor> losses(kMicroBatches), input_grads(kMicroBatches);
    std::vector<int> all(kMicroBatches);
    std::iota(all.begin(), all.end(), 0);
    if (mode == BackwardVariant::kSplitInterleaved) {
      // F0 I0 W0 F1 I1 F2 I2 W2 W1
      for (int mb = 0; mb < kMicroBatches; ++mb) {
        losses[mb] = stage.forward(mb, in.input(mb), in.target(mb));
        input_grads[mb] = stage.backward_input(mb);
        if (mb == 0) stage.backward_weight({0});
      }
      for (int mb = kMicroBatches - 1; mb > 0; --mb) stage.backward_weight({mb});
    } else {
      for (int mb : all) losses[mb] = stage.forward(mb, in.input(mb), in.target(mb));
      for (int mb : all) {
        input_grads[mb] = mode == BackwardVariant::kFused ? stage.backward(mb) : stage.backward_input(mb);
      }
      if (mode == BackwardVariant::kSplitInOrder) {
        for (int mb : all) stage.backward_weight({mb});
      } else if (mode == BackwardVariant::kSplitBatchedShuffled) {
        std::shuffle(all.begin(), all.end(), std::mt19937(3 + step));
        stage.backward_weight(all);
      }
    }
    ASSERT_EQ(stage.live_micro_batches(), 0u);
    ASSERT_EQ(stage.weight_grad_store().pending_bytes(), 0) << "weight work left queued after W";
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      EXPECT_NEAR(losses[mb].item<double>(), ref_losses[mb].item<double>(), 1e-12) << "step " << step << " mb " << mb;
      ASSERT_EQ(input_grads[mb].defined(), ref_input_grads[mb].defined());
      if (input_grads[mb].defined()) {
        EXPECT_LE((input_grads[mb] - ref_input_grads[mb]).abs().max().item<double>(), 1e-10)
            << "input gradient, step " << step << " micro-batch " << mb;
      }
    }
  }
  const std::string mismatch = compare_modules(*candidate, *reference, 1e-10);
  EXPECT_TRUE(mismatch.empty()) << mismatch;
}

struct ClassMode {
  ModuleClass cls;
  BackwardVariant mode;
  bool recompute = false;
};

class SupportedClasses : public ::testing::TestWithParam<ClassMode> {
 protected:
  Float64Default float64_;
};

TEST_P(SupportedClasses, MatchLossBackward) {
  const auto& c = GetParam();
  Inputs in;
  in.recompute = c.recompute;
  run_class([&] { return c.cls.make(kDim); }, c.mode, in);
}

TEST_P(SupportedClasses, MatchLossBackwardOnTheFirstStage) {
  // Stage 0: the input needs no gradient, so general-path work happens in W only.
  const auto& c = GetParam();
  Inputs in;
  in.stage_index = 0;
  in.recompute = c.recompute;
  run_class([&] { return c.cls.make(kDim); }, c.mode, in);
}

std::vector<ClassMode> class_modes() {
  std::vector<ClassMode> out;
  for (const auto& cls : supported_module_classes()) {
    for (BackwardVariant m : kBackwardVariants) out.push_back({cls, m});
    // Activation recomputation: fused, and 2BP with W batched and interleaved with I. (Dropped draws from a
    // generator of its own: see RecomputationOfAPrivateGenerator below.)
    if (cls.name == "Dropped") continue;
    for (BackwardVariant m : {BackwardVariant::kFused, BackwardVariant::kSplitBatchedShuffled,
                              BackwardVariant::kSplitInterleaved}) {
      out.push_back({cls, m, true});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Classes, SupportedClasses, ::testing::ValuesIn(class_modes()),
                         [](const auto& info) {
                           return info.param.cls.name + "_" + variant_name(info.param.mode) +
                                  (info.param.recompute ? "_recompute" : "");
                         });

/// First stage: a fast Embedding feeding general layers (LayerNorm, Linear) and a fast Linear.
struct EmbeddingIntoGeneral : CaseModule {
  EmbeddingIntoGeneral() {
    embed = register_module("embed", twobp::nn::Embedding(9, kDim));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    general = register_module("general", torch::nn::Linear(kDim, kDim));
    fast = register_module("fast", twobp::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& ids) override { return fast(torch::gelu(general(norm(embed(ids))))); }
  twobp::nn::Embedding embed{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear general{nullptr};
  twobp::nn::Linear fast{nullptr};
};

class SplitClasses : public ::testing::TestWithParam<BackwardVariant> {
 protected:
  Float64Default float64_;
};

TEST_P(SplitClasses, FastEmbeddingFeedingGeneralLayersOnTheFirstStage) {
  Inputs in;
  in.stage_index = 0;
  in.input = [](int mb) { return torch::randint(0, 9, {2, 2 + mb}, seeded(40 + mb)).to(torch::kLong); };
  run_class([] { return std::make_shared<EmbeddingIntoGeneral>(); }, GetParam(), in);
}

/// torch::nn::Dropout (global generator): the reference and the stage draw masks in the same forward order.
struct TorchDropout : CaseModule {
  TorchDropout() {
    general = register_module("general", torch::nn::Linear(kDim, kDim));
    dropout = register_module("dropout", torch::nn::Dropout(0.4));
    fast = register_module("fast", twobp::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fast(dropout(general(x))) + x; }
  torch::nn::Linear general{nullptr};
  torch::nn::Dropout dropout{nullptr};
  twobp::nn::Linear fast{nullptr};
};

// What the random-draw tests share: stage 1 of mse with loss scale 1/kMicroBatches, and the two sides' loops.
StageOptions random_stage_options(bool recompute) {
  StageOptions options;
  options.stage_index = 1;
  options.loss = mse;
  options.loss_scale = 1.0 / kMicroBatches;
  options.recompute = recompute;
  return options;
}

// loss.backward() of every micro-batch, `before(mb)` first.
void run_reference(CaseModule& reference, const std::function<void(int)>& before = nullptr) {
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    if (before) before(mb);
    (mse(reference.forward(activation(mb, 1)), activation(mb, 2)) / kMicroBatches).backward();
  }
}

// F of every micro-batch in order (`before(mb)` first), then B (fused) or I in `order`, `after_backward()`, then
// one W of every micro-batch.
void run_stage(Stage& stage, BackwardVariant mode, const std::vector<int>& order,
               const std::function<void(int)>& before = nullptr,
               const std::function<void()>& after_backward = nullptr) {
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    if (before) before(mb);
    stage.forward(mb, activation(mb, 1), activation(mb, 2));
  }
  for (int mb : order) {
    if (mode == BackwardVariant::kFused) {
      stage.backward(mb);
    } else {
      stage.backward_input(mb);
    }
  }
  if (after_backward) after_backward();
  if (mode != BackwardVariant::kFused) stage.backward_weight({2, 0, 1});
}

TEST_P(SplitClasses, TorchDropoutWithFixedSeed) {
  // The global generator is reseeded before each micro-batch's forward, in the reference and in the stage alike.
  const BackwardVariant mode = GetParam();
  auto twins = twin_modules([] { return std::make_shared<TorchDropout>(); });
  auto reference = twins.first, candidate = twins.second;
  Stage stage(candidate, [&](const at::Tensor& x) { return candidate->forward(x); }, random_stage_options(false));
  auto reseed = [](int mb) { torch::manual_seed(1000 + mb); };
  run_reference(*reference, reseed);
  run_stage(stage, mode, {0, 1, 2}, reseed);
  const std::string mismatch = compare_modules(*candidate, *reference, 1e-10);
  EXPECT_TRUE(mismatch.empty()) << mismatch;
}

TEST_P(SplitClasses, TorchDropoutWithRecomputationDrawsTheSameMasks) {
  // Recomputation replays each forward with the random state its F started from, whatever was drawn since, and
  // leaves the random stream where it was.
  const BackwardVariant mode = GetParam();
  auto twins = twin_modules([] { return std::make_shared<TorchDropout>(); });
  auto reference = twins.first, candidate = twins.second;
  Stage stage(candidate, [&](const at::Tensor& x) { return candidate->forward(x); }, random_stage_options(true));
  torch::manual_seed(1000);
  run_reference(*reference);
  const double after_reference = torch::rand({1}).item<double>();
  torch::manual_seed(1000);
  run_stage(stage, mode, {2, 1, 0}, nullptr, [&] {
    EXPECT_GT(stage.take_recompute_us(), 0.0);
    EXPECT_EQ(stage.take_recompute_us(), 0.0);
  });
  EXPECT_EQ(torch::rand({1}).item<double>(), after_reference) << "the random stream moved";
  const std::string mismatch = compare_modules(*candidate, *reference, 1e-10);
  EXPECT_TRUE(mismatch.empty()) << mismatch;
}

TEST_P(SplitClasses, RecomputationSwitchedBetweenStepsKeepsTheGradients) {
  // Stage::set_recompute between steps (what twobp::AutoSchedule does): a step without, one with, one without
  // again -- dropout's masks and the summed gradients are those of loss.backward() over the three steps, and only
  // the middle step re-runs forwards. Inside a step (a micro-batch held) the switch is refused, naming the stage.
  const BackwardVariant mode = GetParam();
  auto twins = twin_modules([] { return std::make_shared<TorchDropout>(); });
  auto reference = twins.first, candidate = twins.second;
  Stage stage(candidate, [&](const at::Tensor& x) { return candidate->forward(x); }, random_stage_options(false));
  torch::manual_seed(1000);
  for (int step = 0; step < 3; ++step) run_reference(*reference);
  torch::manual_seed(1000);
  for (int step = 0; step < 3; ++step) {
    stage.set_recompute(step == 1);
    EXPECT_EQ(stage.options().recompute, step == 1);
    run_stage(stage, mode, {1, 2, 0}, nullptr, [&] {
      EXPECT_EQ(stage.take_recompute_us() > 0.0, step == 1) << "step " << step;
    });
  }
  const std::string mismatch = compare_modules(*candidate, *reference, 1e-10);
  EXPECT_TRUE(mismatch.empty()) << mismatch;
  stage.forward(0, activation(0, 1), activation(0, 2));
  expect_error([&] { stage.set_recompute(true); }, {"rank 0 stage 1", "between steps", "micro-batch 0"});
  EXPECT_FALSE(stage.options().recompute);
}

TEST_P(SplitClasses, RecomputationOfAPrivateGeneratorIsRefusedUnlessReplayed) {
  // A module drawing from a generator of its own: recomputation cannot replay it unless told about it; the re-run
  // differs from F and is refused, naming the stage, micro-batch and what to do. Listed in replay_generators, the
  // gradients are exact.
  const BackwardVariant mode = GetParam();
  Float64Default f64;
  auto make = [] { return std::make_shared<Dropped>(kDim); };
  expect_error(
      [&] {
        auto module = make();
        Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, random_stage_options(true));
        run_stage(stage, mode, {0, 1, 2});
      },
      {"rank 0 stage 1 micro-batch 0", "recompute", "replay_generators"});

  auto twins = twin_modules(make);
  auto reference = twins.first, candidate = twins.second;
  StageOptions options = random_stage_options(true);
  options.replay_generators = {candidate->generator};
  Stage stage(candidate, [&](const at::Tensor& x) { return candidate->forward(x); }, options);
  run_reference(*reference);
  run_stage(stage, mode, {0, 1, 2});
  const std::string mismatch = compare_modules(*candidate, *reference, 1e-10);
  EXPECT_TRUE(mismatch.empty()) << mismatch;
}

INSTANTIATE_TEST_SUITE_P(Modes, SplitClasses, ::testing::ValuesIn(kBackwardVariants),
                         [](const auto& info) { return variant_name(info.param); });

// ---- Rejected on the first micro-batch, with what to do instead ----------------------------------------------

StageOptions last_stage_options(int stage_index = 1) {
  StageOptions o;
  o.stage_index = stage_index;
  o.num_stages = stage_index + 1;
  o.rank = 3;
  o.loss = mse;
  return o;
}

TEST(SplitRejects, GradientHookOnAFastPathParameter) {
  Float64Default f;
  auto module = std::make_shared<FastParameterHook>(kDim);
  Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, last_stage_options());
  expect_error([&] { stage.forward(0, activation(0, 1), activation(0, 2)); },
                     {"rank 3 stage 1 micro-batch 0", "Linear", "gradient hook", "torch::nn::Linear"});
}

// A fast-path parameter that ordinary ops use too would get its hook fired by autograd and by the fast path.
TEST(SplitRejects, PostAccumulateGradHookOnAParameterSharedAcrossPaths) {
  Float64Default f;
  for (bool split : {false, true}) {
    SCOPED_TRACE(split ? "2BP" : "fused");
    auto module = std::make_shared<SharedAcrossPaths>(kDim);
    torch::autograd::impl::set_post_acc_grad_hooks(
        module->fc->weight, std::make_unique<RecordingPostAccumulateHook>(std::make_shared<std::vector<double>>()));
    Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, last_stage_options());
    stage.forward(2, activation(0, 1), activation(0, 2));
    expect_error(
        [&] {
          if (split) {
            stage.backward_input(2);
            stage.backward_weight({2});
          } else {
            stage.backward(2);
          }
        },
        {"rank 3 stage 1", "post-accumulate-grad hook", "ordinary ops", "torch::nn::Linear"});
  }
}

struct NoopPostHook : torch::autograd::FunctionPostHook {
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    return outputs;
  }
};

TEST(SplitRejects, NodePostHookOnAWeightBearingNodeIn2bp) {
  Float64Default f;
  auto scale = torch::randn({kDim}).requires_grad_(true);
  auto module = std::make_shared<TorchMlpImpl>(kDim);
  module->register_parameter("scale", scale);
  Stage stage(module,
              [&](const at::Tensor& x) {
                auto h = x * scale;
                h.grad_fn()->add_post_hook(std::make_unique<NoopPostHook>());
                return module->forward(h);
              },
              last_stage_options());
  stage.forward(1, torch::randn({2, kDim}), torch::randn({2, kDim}));
  expect_error([&] { stage.backward_input(1); }, {"micro-batch 1", "post-hook", "MulBackward0"});
}

// ---- Fast-path W: saved tensors, precision, lifetime ---------------------------------------------------------

/// Keeps the tensor its fast Linear saves for W, so a test can modify it in place between I and W.
struct ExposedInput : torch::nn::Module {
  ExposedInput() { fc = register_module("fc", twobp::nn::Linear(kDim, kDim)); }
  torch::Tensor forward(const torch::Tensor& x) {
    saved = torch::tanh(x);
    return fc(saved);
  }
  twobp::nn::Linear fc{nullptr};
  torch::Tensor saved;
};

TEST(FastPathWeightGradients, InputModifiedInPlaceBetweenIAndWIsAnError) {
  Float64Default f;
  auto module = std::make_shared<ExposedInput>();
  Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, last_stage_options());
  stage.forward(0, torch::randn({2, kDim}), torch::randn({2, kDim}));
  stage.backward_input(0);
  {
    torch::NoGradGuard no_grad;
    module->saved.add_(1.0);
  }
  expect_error([&] { stage.backward_weight({0}); },
                     {"rank 3 stage 1 micro-batch 0", "Linear", "in-place", "between I and W"});
  EXPECT_FALSE(module->fc->weight.grad().defined());
}

TEST(FastPathWeightGradients, TokenIdsReusedAsABufferBetweenIAndWIsAnError) {
  twobp::nn::Embedding embed(7, kDim);
  StageOptions o = last_stage_options(0);
  o.loss = [](const torch::Tensor& out, const torch::Tensor&) { return out.pow(2).mean(); };
  Stage stage(embed.ptr(), [&](const at::Tensor& ids) { return embed->forward(ids); }, o);
  auto ids = torch::tensor({{1, 2, 3}}, torch::kLong);
  stage.forward(0, ids, torch::zeros({1}));
  stage.backward_input(0);
  ids.fill_(4);  // a data loader refilling its batch buffer
  expect_error([&] { stage.backward_weight({0}); }, {"micro-batch 0", "Embedding", "in-place"});
}

// 1000 occurrences of a token with gradient 1, in one W: summed in bf16 one row at a time (CUDA's index_add_ with
// atomics, or ATen's CPU embedding backward for a bf16 table) the sum sticks at 256. twobp sums in float32 on every
// device and mode and rounds once, as ATen's CUDA embedding backward does.
void expect_bf16_embedding_sum_in_float32(const torch::Device& device) {
  torch::manual_seed(0);
  twobp::nn::Embedding fast(5, 8);
  fast->to(device, torch::kBFloat16);
  auto reference = fast->weight.detach().to(torch::kFloat).requires_grad_(true);
  torch::Tensor ids = torch::zeros({1, 1000}, torch::TensorOptions().dtype(torch::kLong).device(device));
  ids.narrow(1, 0, 7).fill_(3);
  StageOptions o = last_stage_options(0);
  o.loss = [](const torch::Tensor& out, const torch::Tensor&) { return out.to(torch::kFloat).sum(); };
  for (bool split : {false, true}) {
    SCOPED_TRACE(split ? "2BP" : "fused");
    fast->weight.mutable_grad().reset();
    Stage stage(fast.ptr(), [&](const at::Tensor& x) { return fast->forward(x); }, o);
    stage.forward(0, ids, torch::zeros({1}, torch::TensorOptions().device(device)));
    if (split) {
      stage.backward_input(0);
      stage.backward_weight({0});
    } else {
      stage.backward(0);
    }
    ASSERT_TRUE(fast->weight.grad().defined());
    EXPECT_EQ(fast->weight.grad().scalar_type(), torch::kBFloat16);
    EXPECT_EQ(fast->weight.grad()[0][0].item<float>(), 992.0f) << "993 occurrences, rounded to bf16 once";
  }
  at::embedding(reference, ids).sum().backward();
  EXPECT_TRUE(torch::equal(fast->weight.grad().cpu(), reference.grad().to(torch::kBFloat16).cpu()));
}

TEST(FastPathWeightGradients, Bf16EmbeddingSumsRepeatedRowsInFloat32) { expect_bf16_embedding_sum_in_float32(torch::kCPU); }

TEST(FastPathWeightGradients, Bf16EmbeddingSumsRepeatedRowsInFloat32OnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_bf16_embedding_sum_in_float32(torch::kCUDA);
}

/// Records weak references to the micro-batch's stage input and its output's autograd node.
struct Observed : torch::nn::Module {
  explicit Observed(bool fast_path) {
    if (fast_path) {
      fast = register_module("fast", twobp::nn::Linear(kDim, kDim));
    } else {
      general = register_module("general", torch::nn::Linear(kDim, kDim));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    input.emplace(x.getIntrusivePtr());
    auto y = fast ? fast(x) : general(x);
    y = torch::tanh(y) * 2.0;
    node = y.grad_fn();
    return y;
  }
  twobp::nn::Linear fast{nullptr};
  torch::nn::Linear general{nullptr};
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> input;
  std::weak_ptr<torch::autograd::Node> node;
};

TEST(SplitLifetime, GraphAndStageInputAreFreedAfterW) {
  Float64Default f;
  for (bool fast_path : {true, false}) {
    SCOPED_TRACE(fast_path ? "fast path" : "general path");
    auto module = std::make_shared<Observed>(fast_path);
    StageOptions o;
    o.stage_index = 1;
    o.num_stages = 3;
    Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, o);
    stage.forward(0, torch::randn({2, kDim}));
    ASSERT_TRUE(module->input.has_value());
    EXPECT_FALSE(module->input->expired());
    EXPECT_FALSE(module->node.expired());
    stage.backward_input(0, torch::randn({2, kDim}));
    stage.backward_weight({0});
    EXPECT_TRUE(module->input->expired()) << "the stage input is still referenced after W";
    EXPECT_TRUE(module->node.expired()) << "the micro-batch's autograd graph is still alive after W";
    ASSERT_TRUE(module->parameters()[0].grad().defined());
  }
}

TEST(StageParameters, EachTensorOnceByIdentity) {
  RegisteredTwice twice(kDim);
  EXPECT_EQ(twice.parameters().size(), 8u);
  auto module = std::make_shared<RegisteredTwice>(kDim);
  Stage stage(module, [&](const at::Tensor& x) { return module->forward(x); }, StageOptions{});
  EXPECT_EQ(stage.parameters().size(), 4u);
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

// A StageDropout stage as rank threads have it (ranks_share_process), built from a fixed seed.
struct DropoutStage {
  DropoutStage() {
    torch::manual_seed(11);
    module = std::make_shared<StageDropout>(kDim);
    StageOptions options = random_stage_options(false);
    options.ranks_share_process = true;
    auto raw = module;
    stage = std::make_unique<Stage>(module, [raw](const at::Tensor& x) { return raw->forward(x); }, options);
  }
  // `forwards` F + B of one micro-batch each; the losses.
  std::vector<double> run(int forwards) {
    std::vector<double> losses;
    for (int k = 0; k < forwards; ++k) {
      const int mb = k % kMicroBatches;
      losses.push_back(stage->forward(mb, activation(mb, 1), activation(mb, 2)).item<double>());
      stage->backward(mb);
    }
    return losses;
  }
  std::shared_ptr<StageDropout> module;
  std::unique_ptr<Stage> stage;
};

// Two threads with a Stage each, as ranks as threads have: one draws dropout masks (nn::Dropout, its stage's own
// stream), the other recomputes its forwards. The recomputation saves and restores no process-wide generator, so
// the first thread's losses are bitwise those it computes alone, in each of 20 runs. (Before, the recomputing
// stage restored LibTorch's default generator under the other thread's draws: 3-5 of 5 runs differed.)
TEST(StageThreads, RecomputationOnOneThreadLeavesAnotherThreadsDrawsAlone) {
  Float64Default f64;
  const std::vector<double> alone = DropoutStage().run(100);
  for (int run = 0; run < 20; ++run) {
    DropoutStage mine;
    torch::manual_seed(12);
    auto other_module = std::make_shared<TorchDropout>();
    other_module->dropout->eval();  // draws nothing; every forward is recomputed
    StageOptions options = random_stage_options(true);
    options.ranks_share_process = true;
    Stage other(other_module, [other_module](const at::Tensor& x) { return other_module->forward(x); }, options);
    std::atomic<bool> done{false};
    std::exception_ptr error;
    std::thread thread([&] {
      try {
        for (int k = 0; !done && k < 100000; ++k) {
          other.forward(0, activation(0, 1), activation(0, 2));
          other.backward(0);
        }
      } catch (...) {
        error = std::current_exception();
      }
    });
    const std::vector<double> together = mine.run(100);
    done = true;
    thread.join();
    if (error) std::rethrow_exception(error);
    ASSERT_EQ(together, alone) << "run " << run;
  }
}

}  // namespace
}  // namespace twobp::testing
