// The GPU-only code paths of the 2BP split, against their CPU/composite counterparts: LibTorch's fused RMSNorm
// (its backward asked for exactly I's or exactly W's output), the rotary node, and W's float32-output GEMMs into
// a float32 master's gradient. Every test skips without a CUDA device (label gpu).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "common/test_models.h"
#include "twobp/autograd/weight_grad_store.h"
#include "twobp/nn.h"
#include "twobp/stage.h"

namespace twobp::testing {
namespace {

const c10::Device kCuda(c10::kCUDA, 0);

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the GPU code paths need one GPU"

/// RMSNorm → Linear → RMSNorm, the norms fused on CUDA or composite.
struct NormedMlp : torch::nn::Module {
  explicit NormedMlp(bool fused) {
    first = register_module("first", twobp::nn::RMSNorm(twobp::nn::RMSNormOptions(8).fused_on_cuda(fused)));
    fc = register_module("fc", twobp::nn::Linear(8, 8));
    second = register_module("second", twobp::nn::RMSNorm(twobp::nn::RMSNormOptions(8).fused_on_cuda(fused)));
    torch::NoGradGuard no_grad;
    first->weight.uniform_(0.5, 1.5);
    second->weight.uniform_(0.5, 1.5);
  }
  torch::Tensor forward(const torch::Tensor& x) { return second(torch::tanh(fc(first(x)))); }
  twobp::nn::RMSNorm first{nullptr}, second{nullptr};
  twobp::nn::Linear fc{nullptr};
};

enum class Order { kFused, kInOrder, kReversed, kBatched };

// Three micro-batches through a Stage in `order`; returns every gradient (input gradients, then parameters').
std::vector<torch::Tensor> run_stage(bool fused, Order order) {
  torch::manual_seed(3);
  auto module = std::make_shared<NormedMlp>(fused);
  module->to(kCuda, torch::kDouble);
  StageOptions so;
  so.stage_index = 1;
  so.num_stages = 3;
  Stage stage(module, [m = module.get()](const at::Tensor& x) { return m->forward(x); }, so);
  std::vector<torch::Tensor> out;
  auto data = [](int mb, int salt) {
    return torch::randn({2, 3 + mb, 8}, torch::Generator(at::detail::createCPUGenerator(10 * mb + salt)))
        .to(kCuda, torch::kDouble);
  };
  for (int mb = 0; mb < 3; ++mb) stage.forward(mb, data(mb, 1));
  for (int mb = 0; mb < 3; ++mb) {
    out.push_back(order == Order::kFused ? stage.backward(mb, data(mb, 2)) : stage.backward_input(mb, data(mb, 2)));
  }
  if (order == Order::kInOrder) for (int mb = 0; mb < 3; ++mb) stage.backward_weight({mb});
  if (order == Order::kReversed) for (int mb = 2; mb >= 0; --mb) stage.backward_weight({mb});
  if (order == Order::kBatched) stage.backward_weight({2, 0, 1});
  for (const auto& p : module->parameters()) out.push_back(p.grad());
  return out;
}

TEST(FusedRmsNorm, MatchesTheCompositeInEveryOrderOfIAndW) {
  SKIP_WITHOUT_CUDA();
  const std::vector<torch::Tensor> reference = run_stage(/*fused=*/false, Order::kFused);
  for (bool fused : {true, false}) {
    for (Order order : {Order::kFused, Order::kInOrder, Order::kReversed, Order::kBatched}) {
      SCOPED_TRACE(std::string(fused ? "fused" : "composite") + " order " + std::to_string(static_cast<int>(order)));
      const std::vector<torch::Tensor> got = run_stage(fused, order);
      ASSERT_EQ(got.size(), reference.size());
      for (std::size_t k = 0; k < got.size(); ++k) {
        ASSERT_TRUE(got[k].defined()) << k;
        EXPECT_LE((got[k] - reference[k]).abs().max().item<double>(), 1e-10) << "gradient " << k;
      }
    }
  }
}

TEST(RotaryNode, MatchesTheCompositeFormulaOnCuda) {
  SKIP_WITHOUT_CUDA();
  Float64Default f;
  torch::manual_seed(5);
  const twobp::nn::RotaryEmbedding rotary(8);
  auto a = torch::randn({2, 3, 6, 8}).to(kCuda).requires_grad_(true);
  auto b = a.detach().clone().requires_grad_(true);
  const auto r = torch::randn({2, 3, 6, 8}).to(kCuda);
  (rotary(a) * r).sum().backward();
  (apply_rotary(b) * r).sum().backward();
  EXPECT_LE((a.grad() - b.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_EQ(rotary.tables(a).cos.device(), a.device());
}

// W's bfloat16 GEMMs write float32 into the master's gradient: the first with mm's out_dtype, the next ones
// accumulating with baddbmm's (beta = 1). Against float64 products of the same bfloat16 values.
TEST(MixedPrecisionGemm, BfloatProductsAccumulateInFloat32Masters) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(7);
  auto compute = torch::zeros({16, 24}, torch::kBFloat16).to(kCuda).requires_grad_(true);
  auto master = torch::zeros({16, 24}).to(kCuda).requires_grad_(true);
  autograd::set_master_gradient(compute, master);
  torch::Tensor exact = torch::zeros({16, 24}, torch::kDouble);
  for (int k = 0; k < 3; ++k) {
    const auto a = torch::randn({16, 40}).to(kCuda, torch::kBFloat16);
    const auto b = torch::randn({40, 24}).to(kCuda, torch::kBFloat16);
    autograd::accumulate_matmul(compute, a, b);
    exact += a.cpu().to(torch::kDouble).mm(b.cpu().to(torch::kDouble));
  }
  EXPECT_FALSE(compute.grad().defined());
  ASSERT_EQ(master.grad().scalar_type(), torch::kFloat);
  EXPECT_LE((master.grad().cpu().to(torch::kDouble) - exact).abs().max().item<double>(),
            1e-5 * exact.abs().max().item<double>())
      << "no bfloat16 rounding of the products";
}

// Batched W under mixed precision on CUDA: one GEMM over the concatenated micro-batches, into the float32 master,
// equals one GEMM per micro-batch up to float32 summation order.
TEST(MixedPrecisionGemm, BatchedEqualsUnbatched) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(9);
  std::vector<autograd::WeightGradItem> items;
  for (int mb = 0; mb < 4; ++mb) {
    items.push_back({torch::randn({2, 5, 16}).to(kCuda, torch::kBFloat16),
                     torch::randn({2, 5, 12}).to(kCuda, torch::kBFloat16)});
  }
  std::vector<torch::Tensor> grads;
  for (auto batching : {nn::functional::Batching::kConcatenate, nn::functional::Batching::kSeparate}) {
    auto weight = torch::zeros({12, 16}, torch::kBFloat16).to(kCuda).requires_grad_(true);
    auto master = torch::zeros({12, 16}).to(kCuda).requires_grad_(true);
    autograd::set_master_gradient(weight, master);
    nn::functional::linear_weight_grad(weight, {}, items, batching);
    grads.push_back(master.grad().cpu());
  }
  EXPECT_LE((grads[0] - grads[1]).abs().max().item<float>(), 1e-5 * grads[1].abs().max().item<float>());
}

}  // namespace
}  // namespace twobp::testing
