// StageTimer (twobp/plan/stage_timer.h): what it runs is the stage's F, I, W and B on its input and output gradient
// -- the values it reports match autograd's on a copy of the module (float64, every parameter, frozen ones without a
// gradient, buffers), a batched W accumulates what separate W's do, mixed precision writes the masters' gradients --
// and its timings and counts are of those phases.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "common/expect_error.h"
#include "common/test_models.h"
#include "twobp/metrics/memory.h"
#include "twobp/plan/stage_timer.h"

namespace twobp::testing {
namespace {

using ModuleFactory = std::function<std::shared_ptr<torch::nn::Module>()>;

struct Model {
  std::string name;
  ModuleFactory make;  // the same weights on every call
  std::vector<int64_t> input_shape;
};

// The module's forward, whichever test model it is.
at::Tensor run(const std::shared_ptr<torch::nn::Module>& module, const at::Tensor& x) {
  if (auto* m = module->as<FastMlpImpl>()) return m->forward(x);
  if (auto* m = module->as<TorchMlpImpl>()) return m->forward(x);
  if (auto* m = module->as<TinyBlockImpl>()) return m->forward(x);
  if (auto* m = module->as<BufferedImpl>()) return m->forward(x);
  return module->as<ConvNetImpl>()->forward(x);
}

StageForward forward_of(const std::shared_ptr<torch::nn::Module>& module) {
  return [module](const at::Tensor& x) { return run(module, x); };
}

template <typename M, typename... Args>
ModuleFactory seeded(Args... args) {
  return [=] {
    torch::manual_seed(5);
    return std::static_pointer_cast<torch::nn::Module>(M(args...).ptr());
  };
}

std::vector<Model> models() {
  return {{"fast_mlp", seeded<FastMlp>(int64_t{6}), {3, 6}},
          {"torch_mlp", seeded<TorchMlp>(int64_t{5}), {4, 5}},
          {"tiny_block", seeded<TinyBlock>(int64_t{8}, int64_t{2}, int64_t{1}, int64_t{16}), {2, 4, 8}},
          {"buffered", seeded<Buffered>(int64_t{4}), {3, 4}},
          {"conv_batch_norm", seeded<ConvNet>(int64_t{2}), {2, 2, 5, 5}}};
}

class StageTimerValues : public ::testing::TestWithParam<int> {};

// values() against autograd on a copy of the module: output, input gradient, every parameter's .grad (a frozen
// parameter has none), and the buffers after as many forwards (construction runs one).
TEST_P(StageTimerValues, MatchAutogradOnACopyInFloat64) {
  Float64Default f64;
  const Model model = models()[GetParam()];
  SCOPED_TRACE(model.name);
  std::shared_ptr<torch::nn::Module> timed = model.make(), reference = model.make();
  const std::string frozen = timed->named_parameters().keys().front();
  timed->named_parameters()[frozen].set_requires_grad(false);
  reference->named_parameters()[frozen].set_requires_grad(false);
  torch::manual_seed(11);
  const at::Tensor input = torch::randn(model.input_shape);
  StageTimer timer(timed, forward_of(timed), input);
  const std::map<std::string, at::Tensor> v = timer.values();

  run(reference, input);  // the timer's untimed forward at construction (buffers move in train mode)
  const at::Tensor x = input.detach().requires_grad_(true);
  const at::Tensor out = run(reference, x);
  out.backward(timer.grad_output());
  EXPECT_TRUE(torch::allclose(v.at("output"), out.detach().to(at::kFloat)));
  ASSERT_EQ(v.count("input gradient"), 1u);
  EXPECT_TRUE(torch::allclose(v.at("input gradient"), x.grad().to(at::kFloat), 1e-5, 1e-6));
  for (const auto& item : reference->named_parameters()) {
    const auto it = v.find(item.key() + ".grad");
    ASSERT_EQ(it != v.end(), item.value().grad().defined()) << item.key();
    if (it != v.end()) EXPECT_TRUE(torch::allclose(it->second, item.value().grad().to(at::kFloat), 1e-5, 1e-6)) << item.key();
  }
  EXPECT_EQ(v.count(frozen + ".grad"), 0u);
  const auto buffers = timed->named_buffers();
  for (const auto& item : reference->named_buffers()) {
    EXPECT_TRUE(torch::allclose(buffers[item.key()].to(at::kDouble), item.value().to(at::kDouble))) << item.key();
  }
}

INSTANTIATE_TEST_SUITE_P(Models, StageTimerValues, ::testing::Range(0, 5));

// A W of m micro-batches at once accumulates what m W's one by one do: m times one micro-batch's gradient here
// (every micro-batch has the same input and output gradient).
TEST(StageTimer, BatchedAndSeparateWeightGradientsAccumulateAlike) {
  Float64Default f64;
  for (const Model& model : models()) {
    SCOPED_TRACE(model.name);
    std::shared_ptr<torch::nn::Module> module = model.make();
    StageTimer timer(module, forward_of(module), torch::randn(model.input_shape));
    const std::map<std::string, at::Tensor> one = timer.values();
    for (bool batched : {true, false}) {
      const PhaseTime t = timer.weight_batch(3, batched);
      EXPECT_GE(t.synced_ms, t.host_ms);
      for (const auto& item : module->named_parameters()) {
        ASSERT_TRUE(item.value().grad().defined()) << item.key();
        EXPECT_TRUE(torch::allclose(item.value().grad().to(at::kFloat), 3 * one.at(item.key() + ".grad"), 1e-4,
                                    1e-6))
            << item.key() << (batched ? " batched" : " separate");
      }
    }
  }
  std::shared_ptr<torch::nn::Module> module = models()[0].make();
  StageTimer timer(module, forward_of(module), torch::randn(models()[0].input_shape));
  expect_error([&] { timer.weight_batch(0, true); }, {"micro_batches", ">= 1"});
}

// Mixed precision: the module computes in bfloat16, the gradients land on float32 masters (the module's own .grad
// stays none, as in the pipeline) and agree with float64 autograd to bfloat16's rounding.
TEST(StageTimer, MixedPrecisionWritesTheMastersGradients) {
  for (const Model& model : models()) {
    SCOPED_TRACE(model.name);
    if (model.name == "conv_batch_norm") continue;  // batch norm's statistics are float32-only here
    std::shared_ptr<torch::nn::Module> module = model.make(), reference = model.make();
    torch::manual_seed(2);
    const at::Tensor input = torch::randn(model.input_shape);
    StageTimerOptions options;
    options.mixed_precision = true;
    StageTimer timer(module, forward_of(module), input.to(at::kBFloat16), options);
    const std::map<std::string, at::Tensor> v = timer.values();
    reference->to(at::kDouble);
    const at::Tensor out = run(reference, input.to(at::kDouble));
    out.backward(timer.grad_output().to(at::kDouble));
    for (const auto& item : reference->named_parameters()) {
      const at::Tensor got = v.at(item.key() + ".grad"), want = item.value().grad().to(at::kFloat);
      EXPECT_LT((got - want).norm().item<double>(), 5e-2 * want.norm().item<double>() + 1e-3) << item.key();
    }
    timer.split(/*existing_gradients=*/false);
    for (const auto& item : module->named_parameters()) {
      EXPECT_EQ(item.value().scalar_type(), at::kBFloat16) << item.key();
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
    }
  }
  std::shared_ptr<torch::nn::Module> module = models()[0].make();
  StageTimerOptions options;
  options.mixed_precision = true;
  expect_error([&] { StageTimer(module, forward_of(module), torch::randn({3, 6}), options); },
               {"mixed precision", "Float", "bfloat16"});
}

// The phases' counts and times are of the phases: F, I, W, F, B counted in that order, each with operators; every
// synced time at least its host time; a device timing refused on the CPU; with the CPU allocation counter a phase's
// peak above its start is reported (activations, gradients), else -1.
TEST(StageTimer, CountsTimesAndPeaksArePerPhase) {
  const bool counting = memory::counting_cpu_allocations();  // installed by an earlier test of this process
  std::shared_ptr<torch::nn::Module> module = models()[2].make();
  StageTimer timer(module, forward_of(module), torch::randn(models()[2].input_shape));
  const std::vector<StageTimer::PhaseOps> ops = timer.count_ops(/*by_name=*/true);
  ASSERT_EQ(ops.size(), 5u);
  const char* phases[] = {"F", "I", "W", "F", "B"};
  for (std::size_t k = 0; k < ops.size(); ++k) {
    EXPECT_EQ(ops[k].phase, phases[k]);
    EXPECT_GT(ops[k].ops, 0) << phases[k];
    EXPECT_FALSE(ops[k].by_name.empty()) << phases[k];
  }
  EXPECT_GT(ops[4].ops, ops[1].ops);  // B does I's work and W's
  for (bool existing : {false, true}) {
    const StageTimer::Split s = timer.split(existing);
    const StageTimer::Fused b = timer.fused(existing);
    for (const PhaseTime& t : {s.forward, s.input, s.weight, b.forward, b.backward}) {
      EXPECT_GT(t.synced_ms, 0.0);
      EXPECT_GE(t.synced_ms, t.host_ms);
    }
  }
  if (!counting) EXPECT_EQ(timer.peak_above_phase_start_bytes(), -1);
  expect_error([&] { timer.device_timed(); }, {"device_timed", "CPU"});
  EXPECT_EQ(timer.parameter_count(), [&] {
    int64_t n = 0;
    for (const auto& p : module->parameters()) n += p.numel();
    return n;
  }());

  memory::count_cpu_allocations();
  std::shared_ptr<torch::nn::Module> counted = models()[2].make();
  StageTimer measured(counted, forward_of(counted), torch::randn(models()[2].input_shape));
  measured.split(false);
  EXPECT_GT(measured.peak_above_phase_start_bytes(), 0);
  EXPECT_GE(measured.peak_bytes(), measured.peak_above_phase_start_bytes());
  // Not recorded when asked not to: no peak reset, none reported.
  StageTimerOptions quiet;
  quiet.record_memory = false;
  StageTimer unrecorded(counted, forward_of(counted), torch::randn(models()[2].input_shape), quiet);
  unrecorded.split(false);
  EXPECT_EQ(unrecorded.peak_above_phase_start_bytes(), -1);
  EXPECT_EQ(unrecorded.peak_bytes(), -1);
}

TEST(StageTimer, ClockNames) {
  EXPECT_EQ(parse_clock("wall"), TimerClock::kWall);
  EXPECT_EQ(parse_clock("cpu"), TimerClock::kProcessCpu);
  expect_error([] { parse_clock("gpu"); }, {"gpu", "wall or cpu"});
  const double a = now_ms(TimerClock::kWall);
  EXPECT_GE(now_ms(TimerClock::kWall), a);
}

// compare_values: the largest relative difference over the entries both hold, where it is, what was not compared.
TEST(StageTimer, CompareValuesFindsTheLargestDifferenceAndWhatIsMissing) {
  const std::map<std::string, at::Tensor> b{{"output", at::full({2, 3}, 2.0)},
                                            {"w.grad", at::full({4}, 1.0)},
                                            {"v.grad", at::zeros({2})}};
  std::map<std::string, at::Tensor> a = b;
  ValueComparison same = compare_values(a, b);
  EXPECT_EQ(same.compared, 3);
  EXPECT_EQ(same.max_relative_difference, 0.0);
  EXPECT_TRUE(same.within(0.0));
  a["w.grad"] = at::full({4}, 1.5);  // ||0.5 x 4|| / ||1 x 4|| = 0.5
  a["output"] = at::full({2, 3}, 2.2);  // 0.1
  ValueComparison off = compare_values(a, b);
  EXPECT_EQ(off.worst, "w.grad");
  EXPECT_NEAR(off.max_relative_difference, 0.5, 1e-6);
  EXPECT_FALSE(off.within(0.4));
  EXPECT_TRUE(off.within(0.6));
  a["v.grad"] = at::full({2}, 0.25);  // b's norm is 0: the absolute difference, sqrt(2) / 4
  EXPECT_EQ(compare_values(a, b).worst, "w.grad");
  a["output"] = at::full({2, 3}, std::nan(""));
  EXPECT_EQ(compare_values(a, b).worst, "output") << "a NaN is the largest difference";
  a.erase("w.grad");
  a["v.grad"] = at::zeros({3});  // another shape
  ValueComparison partial = compare_values(a, b);
  EXPECT_EQ(partial.not_compared, (std::vector<std::string>{"v.grad", "w.grad"}));
  EXPECT_EQ(partial.compared, 1);
  EXPECT_FALSE(partial.within(1e9));
  EXPECT_FALSE(compare_values(a, {}).within(1e9)) << "nothing compared";
}

}  // namespace
}  // namespace twobp::testing
