// CUDA parity on ONE GPU: the pipeline on the Local transport with every rank's stages on cuda:0 and every rank
// (thread) on its own CUDA stream, every schedule x {standard, 2BP}, against a single-process CUDA reference
// built from the same seed. The transport pairs in order per channel, as NCCL does. Chunks alternate between the
// fast path (twobp::nn::Linear) and the general path (torch::nn::Linear), so both halves of the split run.
//
// Tolerances: float32 rtol 1e-5 (atol 1e-6): the pipeline may sum W over micro-batches in another order (batched
// W concatenates on CUDA). bfloat16 rtol 2e-2, atol 2e-2: one bf16 ulp is 2^-8 relative, and the reference
// rounds its gradient accumulation differently.
//
// Skips with the reason when no CUDA device is visible.

#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <exception>

#include "common/pipeline_fixtures.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

struct CudaCase {
  std::string schedule;
  BackwardMode mode;
  int p;
  at::ScalarType dtype;
};

class PipelineCudaParity : public ::testing::TestWithParam<CudaCase> {};

TEST_P(PipelineCudaParity, MatchesSingleProcessCudaReference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the CUDA parity tests need one GPU";
  const CudaCase c = GetParam();
  const int m = 2 * c.p;
  const c10::Device dev(c10::kCUDA, 0);
  const Schedule schedule = make_schedule(c.schedule, default_schedule_options(c.schedule, c.p, m, c.mode));
  const auto to = torch::TensorOptions().device(dev).dtype(c.dtype);

  torch::manual_seed(7);
  auto inputs = torch::randn({m * kMicroBatchSize, kDim}).to(to);
  auto targets = torch::randn({m * kMicroBatchSize, kDim}).to(to);

  // Reference: one process, default stream, the whole model, loss averaged over micro-batches.
  std::vector<std::shared_ptr<torch::nn::Module>> ref;
  std::vector<double> ref_losses;
  for (int s = 0; s < schedule.num_stages; ++s) {
    ref.push_back(make_chunk(s));
    ref.back()->to(dev, c.dtype);
  }
  auto xs = inputs.split(kMicroBatchSize), ys = targets.split(kMicroBatchSize);
  for (int mb = 0; mb < m; ++mb) {
    torch::Tensor h = xs[mb];
    for (int s = 0; s < schedule.num_stages; ++s) h = run_chunk(*ref[s], s, h);
    auto loss = mse(h, ys[mb]);
    (loss / m).backward();
    ref_losses.push_back(loss.item<double>());
  }

  LocalOptions lo;
  lo.pairing = Pairing::kInOrderPerChannel;
  lo.devices = {dev};
  auto transports = make_local_transports(c.p, lo);
  PipelineOptions o;
  o.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.activation_spec = [&](int) { return TensorSpec{{kMicroBatchSize, kDim}, c.dtype}; };
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>> modules(c.p);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  for (int r = 0; r < c.p; ++r) {
    std::vector<PipelineChunk> chunks;
    modules[r].resize(schedule.num_stages);
    for (int s : schedule.stages_of(r)) {
      auto module = make_chunk(s);
      module->to(dev, c.dtype);
      modules[r][s] = module;
      chunks.push_back({s, module, [raw = module.get(), s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
    }
    pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks),
                                                   std::shared_ptr<Transport>(std::move(transports[r])), o));
  }
  std::vector<StepResult> results(c.p);
  std::vector<Transport*> transports_of;
  for (auto& p : pipelines) transports_of.push_back(&p->transport());
  run_rank_threads(
      transports_of,
      [&](Transport& t) {
        const int r = t.rank();
        // Each rank on its own stream: what the transport's stream ordering must survive.
        const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
        c10::StreamGuard guard(impl->getStreamFromGlobalPool(dev));
        results[r] = pipelines[r]->step(inputs, targets);
        impl->synchronizeStream(impl->getStream(dev));
      },
      /*abort_on_error=*/false)
      .rethrow_root_cause();
  const bool bf16 = c.dtype == at::kBFloat16;
  const double rtol = bf16 ? 2e-2 : 1e-5, atol = bf16 ? 2e-2 : 1e-6;
  const int last = schedule.stage_to_rank.back();
  ASSERT_EQ(results[last].losses.size(), static_cast<std::size_t>(m));
  for (int mb = 0; mb < m; ++mb) {
    EXPECT_NEAR(results[last].losses[mb], ref_losses[mb], atol + rtol * std::abs(ref_losses[mb])) << "micro-batch " << mb;
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    auto got = modules[schedule.stage_to_rank[s]][s]->named_parameters();
    for (const auto& item : ref[s]->named_parameters()) {
      const auto& g = got[item.key()].grad();
      ASSERT_TRUE(g.defined()) << "stage " << s << " " << item.key();
      EXPECT_TRUE(torch::allclose(g.to(torch::kFloat), item.value().grad().to(torch::kFloat), rtol, atol))
          << "stage " << s << " " << item.key() << ": max |diff| "
          << (g.to(torch::kFloat) - item.value().grad().to(torch::kFloat)).abs().max().item<float>();
    }
  }
}

std::vector<CudaCase> cuda_cases() {
  std::vector<CudaCase> cases;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) cases.push_back({name, mode, 2, dtype});
      cases.push_back({name, mode, 4, at::kFloat});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, PipelineCudaParity, ::testing::ValuesIn(cuda_cases()), [](const auto& info) {
  std::string n = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard") + "_p" +
                  std::to_string(info.param.p) + (info.param.dtype == at::kBFloat16 ? "_bf16" : "_fp32");
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

}  // namespace
}  // namespace twobp::testing
