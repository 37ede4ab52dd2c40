// Mixed precision (PipelineOptions::mixed_precision): bfloat16 compute, float32 master weights and float32
// gradient accumulation, against a float32 reference run with loss.backward(); ranks as threads.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <exception>
#include <map>

#include "common/expect_error.h"
#include "common/test_models.h"
#include "twobp/autograd/weight_grad_store.h"
#include "twobp/error.h"
#include "twobp/nn/functional.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int64_t kMixedDim = 16;
constexpr int64_t kMixedRows = 8;  // per micro-batch

// Stage s: the fast path (s % 3 == 0), the general path with a frozen bias (1), a custom module with a buffer and
// a parameter used twice (2). Built in float32, as mixed precision requires.
std::shared_ptr<torch::nn::Module> make_mp_chunk(int s) {
  torch::manual_seed(300 + s);
  switch (s % 3) {
    case 0:
      return FastMlp(kMixedDim).ptr();
    case 1: {
      auto m = TorchMlp(kMixedDim);
      m->fc2->bias.set_requires_grad(false);
      return m.ptr();
    }
    default:
      return Buffered(kMixedDim).ptr();
  }
}

torch::Tensor run_mp_chunk(torch::nn::Module& m, int s, const torch::Tensor& x) {
  switch (s % 3) {
    case 0: return static_cast<FastMlpImpl&>(m).forward(x);
    case 1: return static_cast<TorchMlpImpl&>(m).forward(x);
    default: return static_cast<BufferedImpl&>(m).forward(x);
  }
}

struct Reference {
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;
  std::vector<double> losses;
  std::vector<std::map<std::string, at::Tensor>> grads;  // by stage and name: float32
};

// One process, loss.backward() per micro-batch with the pipeline's 1/m scaling. In float32; or (`bf16`) what
// mixed precision means without a pipeline: the chunks in bfloat16, each micro-batch's bfloat16 gradient added to
// a float32 sum.
Reference reference(int stages, int m, const torch::Tensor& inputs, const torch::Tensor& targets, bool bf16) {
  Reference ref;
  for (int s = 0; s < stages; ++s) {
    ref.chunks.push_back(make_mp_chunk(s));
    if (bf16) ref.chunks.back()->to(at::kBFloat16);
  }
  ref.grads.resize(stages);
  auto xs = inputs.split(kMixedRows), ys = targets.split(kMixedRows);
  for (int mb = 0; mb < m; ++mb) {
    torch::Tensor h = bf16 ? xs[mb].to(at::kBFloat16) : xs[mb];
    for (int s = 0; s < stages; ++s) h = run_mp_chunk(*ref.chunks[s], s, h);
    auto loss = mse(h, ys[mb]);
    (loss / m).backward();
    ref.losses.push_back(loss.item<double>());
    for (int s = 0; s < stages; ++s) {
      for (const auto& item : ref.chunks[s]->named_parameters()) {
        at::Tensor& g = const_cast<at::Tensor&>(item.value()).mutable_grad();
        if (!g.defined()) continue;
        at::Tensor& sum = ref.grads[s][item.key()];
        sum = sum.defined() ? sum + g.to(at::kFloat) : g.to(at::kFloat);
        g.reset();
      }
    }
  }
  return ref;
}

struct MixedRun {
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;  // by stage
  std::vector<std::unique_ptr<Pipeline>> pipelines;        // by rank
  std::vector<StepResult> results;                         // by rank
};

PipelineOptions mixed_options() {
  PipelineOptions o;
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.executor.activation_spec = [](int) { return TensorSpec{{kMixedRows, kMixedDim}, at::kBFloat16}; };
  o.mixed_precision.compute_dtype = at::kBFloat16;
  return o;
}

// Builds every rank's pipeline on this thread (the global RNG is not thread-safe), then runs `steps` steps.
MixedRun run_mixed(const Schedule& schedule, const torch::Tensor& inputs, const torch::Tensor& targets,
              std::vector<std::unique_ptr<Transport>>& transports, int steps = 1,
              const std::function<void(Pipeline&)>& between_steps = nullptr) {
  MixedRun run;
  run.chunks.resize(schedule.num_stages);
  run.results.resize(schedule.num_ranks);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    std::vector<PipelineChunk> chunks;
    for (int s : schedule.stages_of(r)) {
      auto module = make_mp_chunk(s);
      run.chunks[s] = module;
      chunks.push_back({s, module, [raw = module.get(), s](const at::Tensor& x) { return run_mp_chunk(*raw, s, x); }});
    }
    run.pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks), *transports[r], mixed_options()));
  }
  RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    for (int k = 0; k < steps; ++k) {
      if (k > 0 && between_steps) between_steps(*run.pipelines[t.rank()]);
      run.results[t.rank()] = run.pipelines[t.rank()]->step(inputs, targets);
    }
  });
  for (const auto& e : errors.errors) {
    if (e) std::rethrow_exception(e);
  }
  return run;
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

struct MixedCase {
  std::string schedule;
  BackwardMode mode;
  int p, m;
};

class MixedPrecisionParity : public ::testing::TestWithParam<MixedCase> {};

// Tolerances, relative to the largest entry of each parameter's reference gradient. Against the same computation
// without a pipeline (bfloat16 chunks, float32 sums of each micro-batch's gradient): 1e-5, float32 summation
// order only (measured: below 1e-6; the fast path's W and autograd round the same bfloat16 products alike on
// CPU). Against float32 training: 12 % -- bfloat16 keeps 8 significant bits, and its error grows with depth
// (measured up to 6 % on the first of 8 stages). Losses: 1 % and 3 %.
TEST_P(MixedPrecisionParity, MastersGetFloat32GradientsOfBfloat16Compute) {
  const MixedCase c = GetParam();
  Schedule schedule;
  try {
    schedule = make_schedule(c.schedule, default_schedule_options(c.schedule, c.p, c.m, c.mode));
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << e.what();
  }
  torch::manual_seed(9);
  auto inputs = torch::randn({c.m * kMixedRows, kMixedDim}), targets = torch::randn({c.m * kMixedRows, kMixedDim});
  const Reference ref = reference(schedule.num_stages, c.m, inputs, targets, /*bf16=*/true);
  const Reference fp32 = reference(schedule.num_stages, c.m, inputs, targets, /*bf16=*/false);
  auto transports = make_local_transports(c.p);
  MixedRun run = run_mixed(schedule, inputs, targets, transports);

  const int last = schedule.stage_to_rank.back();
  ASSERT_EQ(run.results[last].losses.size(), static_cast<std::size_t>(c.m));
  for (int mb = 0; mb < c.m; ++mb) {
    EXPECT_NEAR(run.results[last].losses[mb], ref.losses[mb], 1e-2 * std::abs(ref.losses[mb])) << "micro-batch " << mb;
    EXPECT_NEAR(run.results[last].losses[mb], fp32.losses[mb], 3e-2 * std::abs(fp32.losses[mb])) << "micro-batch " << mb;
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    Pipeline& pipeline = *run.pipelines[schedule.stage_to_rank[s]];
    for (const auto& item : run.chunks[s]->named_parameters()) {
      SCOPED_TRACE("stage " + std::to_string(s) + " " + item.key());
      const at::Tensor& compute = item.value();
      const at::Tensor master = pipeline.master_weight(compute);
      const auto found = ref.grads[s].find(item.key());
      const at::Tensor g_ref = found == ref.grads[s].end() ? at::Tensor() : found->second;
      ASSERT_EQ(g_ref.defined(), fp32.grads[s].count(item.key()) != 0);
      EXPECT_FALSE(compute.grad().defined()) << "the compute parameter's gradient is moved to its master";
      if (!g_ref.defined()) {  // frozen: no master, no gradient, as in the reference
        EXPECT_TRUE(master.is_same(compute));
        EXPECT_FALSE(master.grad().defined());
        continue;
      }
      EXPECT_EQ(compute.scalar_type(), at::kBFloat16);
      EXPECT_EQ(master.scalar_type(), at::kFloat);
      EXPECT_TRUE(torch::equal(compute, master.to(at::kBFloat16))) << "compute weights are the rounded masters";
      ASSERT_TRUE(master.grad().defined());
      ASSERT_EQ(master.grad().scalar_type(), at::kFloat);
      EXPECT_LE(max_abs(master.grad() - g_ref), 1e-5 * max_abs(g_ref)) << "against bfloat16 compute";
      const at::Tensor& g32 = fp32.grads[s].at(item.key());
      EXPECT_LE(max_abs(master.grad() - g32), 0.12 * max_abs(g32)) << "against float32 training";
    }
    // Buffers follow the module into bfloat16, holding the float32 values rounded.
    auto ref_buffers = fp32.chunks[s]->named_buffers();
    for (const auto& item : run.chunks[s]->named_buffers()) {
      EXPECT_EQ(item.value().scalar_type(), at::kBFloat16) << item.key();
      EXPECT_TRUE(torch::equal(item.value(), ref_buffers[item.key()].to(at::kBFloat16))) << item.key();
    }
  }
  // What an optimizer is given: the float32 masters (and frozen tensors), each once.
  for (const auto& pipeline : run.pipelines) {
    for (const auto& p : pipeline->parameters()) {
      EXPECT_TRUE(p.scalar_type() == at::kFloat || !p.requires_grad()) << c10::toString(p.scalar_type());
    }
  }
}

std::vector<MixedCase> mixed_cases() {
  std::vector<MixedCase> cases;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (auto [p, m] : std::vector<std::pair<int, int>>{{2, 4}, {4, 8}}) cases.push_back({name, mode, p, m});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, MixedPrecisionParity, ::testing::ValuesIn(mixed_cases()), [](const auto& info) {
  std::string n = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard") + "_p" +
                  std::to_string(info.param.p) + "_m" + std::to_string(info.param.m);
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

// One weight, 512 micro-batches each contributing exactly 2^-9 to its gradient: float32 accumulation gives 1.0
// exactly, bfloat16 accumulation would stall at 0.5 (256 · 2^-9 + 2^-9 rounds back to 256 · 2^-9). Both paths
// (fast: twobp::nn::Linear; general: torch::nn::Linear), both modes.
TEST(MixedPrecision, GradientsAccumulateInFloat32AcrossMicroBatches) {
  const int m = 512;
  // The claim about bfloat16 this test rests on.
  at::Tensor naive = at::zeros({}, at::kBFloat16);
  for (int k = 0; k < m; ++k) naive += std::ldexp(1.0, -9);
  ASSERT_EQ(naive.item<float>(), 0.5f);
  for (bool fast : {true, false}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      SCOPED_TRACE(std::string(fast ? "fast" : "general") + (mode == BackwardMode::kSplit ? " 2bp" : " standard"));
      const Schedule schedule = make_schedule("gpipe", ScheduleOptions{1, m, 1, mode});
      std::shared_ptr<torch::nn::Module> module;
      at::Tensor weight;
      StageForward forward;
      if (fast) {
        auto l = twobp::nn::Linear(twobp::nn::LinearOptions(1, 1).bias(false));
        module = l.ptr();
        weight = l->weight;
        forward = [raw = l.ptr()](const at::Tensor& x) { return raw->forward(x); };
      } else {
        auto l = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
        module = l.ptr();
        weight = l->weight;
        forward = [raw = l.ptr()](const at::Tensor& x) { return raw->forward(x); };
      }
      {
        torch::NoGradGuard no_grad;
        weight.fill_(1.0);
      }
      PipelineOptions o = mixed_options();
      o.executor.activation_spec = nullptr;
      o.loss = [](const at::Tensor& out, const at::Tensor&) { return out.to(at::kFloat).sum(); };
      auto transports = make_local_transports(1);
      Pipeline pipeline(schedule, {{0, module, forward}}, *transports[0], o);
      pipeline.step(at::ones({m, 1}), at::ones({m, 1}));
      const at::Tensor g = pipeline.master_weight(weight).grad();
      ASSERT_TRUE(g.defined());
      EXPECT_EQ(g.item<float>(), 1.0f) << "512 x 2^-9 summed in float32";
    }
  }
}

// The optimizer steps the masters; the next step computes with them (rounded to bfloat16).
TEST(MixedPrecision, NextStepComputesWithTheUpdatedMasters) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  torch::manual_seed(4);
  auto inputs = torch::randn({4 * kMixedRows, kMixedDim}), targets = torch::randn({4 * kMixedRows, kMixedDim});
  auto transports = make_local_transports(2);
  std::vector<std::unique_ptr<torch::optim::AdamW>> optimizers(2);
  MixedRun run = run_mixed(schedule, inputs, targets, transports, 2, [&](Pipeline& p) {
    auto& opt = optimizers[p.rank()];
    if (!opt) opt = std::make_unique<torch::optim::AdamW>(p.parameters(), torch::optim::AdamWOptions(1e-2));
    opt->step();
    p.zero_grad();
  });
  for (int s = 0; s < 2; ++s) {
    Pipeline& pipeline = *run.pipelines[s];
    auto fresh = make_mp_chunk(s);
    for (const auto& item : run.chunks[s]->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      const at::Tensor master = pipeline.master_weight(item.value());
      EXPECT_TRUE(torch::equal(item.value(), master.to(at::kBFloat16))) << item.key();
      EXPECT_FALSE(torch::equal(master, fresh->named_parameters()[item.key()])) << item.key() << " did not move";
    }
  }
}

void expect_refused(PipelineOptions o, std::shared_ptr<torch::nn::Module> module, const std::string& words) {
  const Schedule schedule = make_schedule("gpipe", ScheduleOptions{1, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(1);
  auto* raw = module.get();
  try {
    Pipeline(schedule, {{0, module, [raw](const at::Tensor& x) { return run_mp_chunk(*raw, 0, x); }}}, *transports[0],
             o);
    ADD_FAILURE() << "expected a UsageError with: " << words;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
}

TEST(MixedPrecision, UnsupportedSetupsAreRefusedAtConstruction) {
  PipelineOptions half = mixed_options();
  half.mixed_precision.compute_dtype = at::kHalf;
  expect_refused(half, make_mp_chunk(0), "dynamic loss scaling");

  auto doubled = make_mp_chunk(0);
  doubled->to(at::kDouble);
  expect_refused(mixed_options(), doubled, "build the chunks in float32");

  auto hooked = FastMlp(kMixedDim);
  struct Noop : torch::autograd::PostAccumulateGradHook {
    void operator()(const torch::autograd::Variable&) override {}
  };
  torch::autograd::impl::set_post_acc_grad_hooks(hooked->fc1->weight, std::make_unique<Noop>());
  expect_refused(mixed_options(), hooked.ptr(), "post-accumulate-grad hook");
  // (Data parallelism is supported: data_parallel_test's MixedDataPipelineParity.)
}

// Masters are made for the parameters that require grad when the Pipeline is built. Freezing one later needs
// nothing (its master keeps the gradient it had); one unfrozen later has no master -- its bfloat16 gradient would
// reach no optimizer -- and the next step is refused before any micro-batch, naming rank, stage and parameter.
TEST(MixedPrecision, FreezingLaterIsFineUnfreezingIsRefused) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  torch::manual_seed(5);
  auto inputs = torch::randn({4 * kMixedRows, kMixedDim}), targets = torch::randn({4 * kMixedRows, kMixedDim});
  {
    auto transports = make_local_transports(2);
    std::map<std::string, at::Tensor> after_step_0;
    MixedRun run = run_mixed(schedule, inputs, targets, transports, 2, [&](Pipeline& p) {
      if (p.rank() != 1) return;
      auto fc1 = p.stage(1).module().named_parameters()["fc1.weight"];
      after_step_0["fc1.weight"] = p.master_weight(fc1).grad().clone();
      after_step_0["fc2.weight"] = p.master_weight(p.stage(1).module().named_parameters()["fc2.weight"]).grad().clone();
      fc1.set_requires_grad(false);
    });
    Pipeline& p = *run.pipelines[1];
    const auto params = run.chunks[1]->named_parameters();
    EXPECT_TRUE(torch::equal(p.master_weight(params["fc1.weight"]).grad(), after_step_0["fc1.weight"]))
        << "a frozen parameter's master keeps the gradient it had";
    const at::Tensor fc2 = p.master_weight(params["fc2.weight"]).grad();
    EXPECT_GT((fc2 - after_step_0["fc2.weight"]).abs().max().item<double>(), 0.0) << "the others still accumulate";
  }
  auto transports = make_local_transports(2);
  expect_error<UsageError>(
      [&] {
        run_mixed(schedule, inputs, targets, transports, 2, [](Pipeline& p) {
          if (p.rank() == 1) p.stage(1).module().named_parameters()["fc2.bias"].set_requires_grad(true);
        });
      },
      {"stage 1: parameter 'fc2.bias' requires grad", "float32 masters", "build a new Pipeline"});
}

// Every step copies the masters over the bfloat16 compute parameters; a write to a compute parameter (weights
// loaded into the chunk, an optimizer over the chunk's own parameters) would be undone without a trace. The next
// step refuses it, naming rank, stage and parameter.
TEST(MixedPrecision, WritingAComputeParameterIsRefused) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  torch::manual_seed(6);
  auto inputs = torch::randn({4 * kMixedRows, kMixedDim}), targets = torch::randn({4 * kMixedRows, kMixedDim});
  auto transports = make_local_transports(2);
  expect_error<UsageError>(
      [&] {
        run_mixed(schedule, inputs, targets, transports, 2, [](Pipeline& p) {
          if (p.rank() != 1) return;
          torch::NoGradGuard no_grad;
          p.stage(1).module().named_parameters()["fc1.weight"].fill_(0.5);
        });
      },
      {"rank 1 stage 1: parameter 'fc1.weight' (its BFloat16 compute copy) was written", "Pipeline::master_weight"});
  // Evaluation copies the masters too: refused alike, and the peer fails at once with the cause (not at its
  // timeout with a TimeoutError).
  auto again = make_local_transports(2);
  MixedRun run = run_mixed(schedule, inputs, targets, again, 1);
  const RankErrors errors = run_rank_threads(again, [&](Transport& t) {
    Pipeline& p = *run.pipelines[t.rank()];
    if (t.rank() == 1) {
      torch::NoGradGuard no_grad;
      p.stage(1).module().named_parameters()["fc1.weight"].fill_(0.5);
    }
    p.evaluate(inputs, targets);
  }, /*abort_on_error=*/false);  // the pipeline itself must tell its peers
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_error<UsageError>([&] { std::rethrow_exception(errors.errors.at(r)); },
                             {"rank 1 stage 1: parameter 'fc1.weight'"});
  }
}

// A fast-path Linear whose W calls are recorded, to see how the store groups them.
struct RecordedLinear : autograd::WeightGradKernel {
  RecordedLinear(at::Tensor weight, at::Tensor bias) : weight(std::move(weight)), bias(std::move(bias)) {}
  void accumulate_weight_grad(c10::ArrayRef<autograd::WeightGradItem> items) const override {
    calls.push_back(items.size());
    nn::functional::linear_weight_grad(weight, bias, items, nn::functional::Batching::kConcatenate);
  }
  std::string kernel_name() const override { return "Linear"; }
  std::vector<at::Tensor> weight_grad_parameters() const override { return {weight, bias}; }
  at::Tensor weight, bias;
  mutable std::vector<std::size_t> calls;
};

// Under mixed precision the gradient goes to the float32 master inside the accumulation (not through a user
// hook), so W stays batched: one call with every micro-batch, one GEMM over their rows, the same gradients as one
// call per micro-batch (up to the bfloat16 rounding of each product on the CPU, where the product is rounded
// before it is added; on CUDA the GEMM writes float32), and nothing in the compute parameters' .grad.
TEST(MixedPrecision, BatchedWeightGradientEqualsUnbatched) {
  torch::manual_seed(8);
  std::vector<at::Tensor> results;
  std::vector<autograd::WeightGradItem> items;
  for (int mb = 0; mb < 3; ++mb) {
    items.push_back({torch::randn({kMixedRows, kMixedDim}).to(at::kBFloat16),
                     torch::randn({kMixedRows, kMixedDim}).to(at::kBFloat16)});
  }
  for (bool batched : {true, false}) {
    SCOPED_TRACE(batched ? "batched" : "one by one");
    RecordedLinear layer(torch::zeros({kMixedDim, kMixedDim}, at::kBFloat16).requires_grad_(true),
                         torch::zeros({kMixedDim}, at::kBFloat16).requires_grad_(true));
    auto master_w = torch::zeros({kMixedDim, kMixedDim}).requires_grad_(true);
    auto master_b = torch::zeros({kMixedDim}).requires_grad_(true);
    autograd::set_master_gradient(layer.weight, master_w);
    autograd::set_master_gradient(layer.bias, master_b);
    autograd::WeightGradStore store;
    store.set_policy(autograd::WeightGradPolicy::kDeferred);
    for (int mb = 0; mb < 3; ++mb) store.on_backward(mb, &layer, items[mb]);
    store.run({0, 1, 2}, batched);
    const std::vector<std::size_t> expected_calls =
        batched ? std::vector<std::size_t>{3} : std::vector<std::size_t>(3, 1);
    EXPECT_EQ(layer.calls, expected_calls);
    EXPECT_FALSE(layer.weight.grad().defined());
    EXPECT_FALSE(layer.bias.grad().defined());
    ASSERT_EQ(master_w.grad().scalar_type(), at::kFloat);
    results.push_back(master_w.grad());
    results.push_back(master_b.grad());
  }
  at::Tensor exact_w = torch::zeros({kMixedDim, kMixedDim}, at::kDouble);
  at::Tensor exact_b = torch::zeros({kMixedDim}, at::kDouble);
  for (const auto& item : items) {
    exact_w += item.grad_output.to(at::kDouble).t().mm(item.input.to(at::kDouble));
    exact_b += item.grad_output.to(at::kDouble).sum(0);
  }
  for (int k : {0, 2}) EXPECT_LE(max_abs(results[k].to(at::kDouble) - exact_w), 1e-2 * max_abs(exact_w)) << k;
  for (int k : {1, 3}) EXPECT_LE(max_abs(results[k].to(at::kDouble) - exact_b), 1e-2 * max_abs(exact_b)) << k;
  EXPECT_LE(max_abs(results[0] - results[2]), 1e-2 * max_abs(exact_w));
}

}  // namespace
}  // namespace twobp::testing
