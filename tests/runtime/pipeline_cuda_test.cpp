// CUDA on ONE GPU: the pipeline on the Local transport with every rank's stages on cuda:0 and every rank (thread)
// on its own CUDA stream.
//  - Parity: every schedule x {standard, 2BP} against a CPU float64 reference on the same (rounded) weights and
//    data. Chunks alternate between the fast path (twobp::nn::Linear) and the general path (torch::nn::Linear), so
//    both halves of the split run. Tolerances, as the relative norm of the difference: float32 1e-5, bfloat16
//    3e-2 (one bf16 rounding is 2^-8 relative; a stage rounds several times).
//  - Stream order: a sender whose tensor is written by a kernel queued behind ~0.1 s of GPU sleep, 16 MiB.
//  - Host syncs: a steady-state step and its optimizer gate synchronize with the device only where documented.
//
// Every test skips with the reason when no CUDA device is visible.

#include <ATen/cuda/Sleep.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <string>

#include "common/pipeline_fixtures.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
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

TEST_P(PipelineCudaParity, MatchesCpuFloat64Reference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the CUDA parity tests need one GPU";
  const CudaCase c = GetParam();
  const int m = 2 * c.p;
  const c10::Device dev(c10::kCUDA, 0);
  const Schedule schedule = make_schedule(c.schedule, default_schedule_options(c.schedule, c.p, m, c.mode));
  const auto to = torch::TensorOptions().device(dev).dtype(c.dtype);

  torch::manual_seed(7);
  // The pipeline's data in its dtype; the reference gets the same (rounded) values in float64 on the CPU.
  auto inputs = torch::randn({m * kMicroBatchSize, kDim}).to(to);
  auto targets = torch::randn({m * kMicroBatchSize, kDim}).to(to);

  // Reference: one process, CPU float64, the whole model, loss averaged over micro-batches.
  std::vector<std::shared_ptr<torch::nn::Module>> ref;
  std::vector<double> ref_losses;
  for (int s = 0; s < schedule.num_stages; ++s) {
    ref.push_back(make_chunk(s));
    ref.back()->to(dev, c.dtype);               // the pipeline's rounding of the weights...
    ref.back()->to(torch::kCPU, torch::kDouble);  // ...held exactly in float64
  }
  auto xs = inputs.to(torch::kCPU, torch::kDouble).split(kMicroBatchSize);
  auto ys = targets.to(torch::kCPU, torch::kDouble).split(kMicroBatchSize);
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
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.executor.activation_spec = [&](int) { return TensorSpec{{kMicroBatchSize, kDim}, c.dtype}; };
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
  const double tolerance = c.dtype == at::kBFloat16 ? 3e-2 : 1e-5;  // relative norm of the difference
  const int last = schedule.stage_to_rank.back();
  ASSERT_EQ(results[last].losses.size(), static_cast<std::size_t>(m));
  for (int mb = 0; mb < m; ++mb) {
    EXPECT_LE(std::abs(results[last].losses[mb] - ref_losses[mb]), tolerance * std::abs(ref_losses[mb]) + 1e-12)
        << "micro-batch " << mb << ": " << results[last].losses[mb] << " vs " << ref_losses[mb];
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    auto got = modules[schedule.stage_to_rank[s]][s]->named_parameters();
    for (const auto& item : ref[s]->named_parameters()) {
      const auto& g = got[item.key()].grad();
      ASSERT_TRUE(g.defined()) << "stage " << s << " " << item.key();
      const auto expected = item.value().grad();
      const double diff = (g.to(torch::kCPU, torch::kDouble) - expected).norm().item<double>();
      EXPECT_LE(diff, tolerance * expected.norm().item<double>() + 1e-12)
          << "stage " << s << " " << item.key() << ": |diff| " << diff << ", |reference| "
          << expected.norm().item<double>();
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

// Rank 0 writes a 16 MiB tensor with a kernel queued behind ~0.1 s of GPU sleep on its own stream and sends it at
// once; rank 1 reads it on another stream right after wait(). Without the transport's stream ordering the
// receiver would see the zeros the tensor held before.
TEST(PipelineCudaStreams, SlowProducerIsWaitedFor) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: this test needs one GPU";
  const c10::Device dev(c10::kCUDA, 0);
  for (bool synchronous : {false, true}) {
    LocalOptions lo;
    lo.devices = {dev};
    lo.synchronous_sends = synchronous;
    auto transports = make_local_transports(2, lo);
    const std::int64_t n = 4 * 1024 * 1024;
    std::atomic<double> received{0.0};
    run_rank_threads(
        transports,
        [&](Transport& t) {
          const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
          c10::StreamGuard guard(impl->getStreamFromGlobalPool(dev));
          const auto opts = at::TensorOptions().device(dev).dtype(at::kFloat);
          if (t.rank() == 0) {
            at::Tensor out = at::zeros({n}, opts);
            at::cuda::sleep(200 * 1000 * 1000);
            out.fill_(3.0f);
            t.isend(out, {1, 5, "SEND slow producer"})->wait(std::chrono::seconds(60));
          } else {
            at::Tensor in = at::zeros({n}, opts);
            t.irecv(in, {0, 5, "RECV slow producer"})->wait(std::chrono::seconds(60));
            received = in.to(at::kDouble).sum().item<double>();
          }
        },
        /*abort_on_error=*/false)
        .rethrow_root_cause();
    EXPECT_EQ(received.load(), 3.0 * static_cast<double>(n)) << (synchronous ? "synchronous" : "eager") << " sends";
  }
}

/// Counts LibTorch's "synchronizing CUDA operation" warnings of the thread it is installed on (warning handlers
/// are per thread), with c10::cuda's sync debug mode set to warn.
class SyncCounter : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchroniz") != std::string::npos) {
      ++count;
    } else {
      c10::WarningHandler::process(warning);
    }
  }
  int count = 0;
};

// A steady-state step (the second) and its optimizer gate synchronize the host with the device only where
// docs/GPU.md ("Host synchronisations in a step") documents it: the step's device timeline (one event), the last
// stage's loss copy, and the gradient check's copy of the per-stage sums. Receives, the schedule's bookkeeping,
// and the norms must not.
TEST(PipelineCudaSyncs, SteadyStateStepSyncsOnlyWhereDocumented) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: this test needs one GPU";
  const c10::Device dev(c10::kCUDA, 0);
  const int p = 2, m = 4;
  for (const char* name : {"1f1b", "zb-v"}) {
    const Schedule schedule = make_schedule(name, default_schedule_options(name, p, m, BackwardMode::kSplit));
    LocalOptions lo;
    lo.pairing = Pairing::kInOrderPerChannel;
    lo.devices = {dev};
    auto transports = make_local_transports(p, lo);
    PipelineOptions o;
    o.executor.timeout = std::chrono::seconds(60);
    o.loss = mse;
    o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kFloat}; };
    std::vector<std::unique_ptr<Pipeline>> pipelines;
    std::vector<std::shared_ptr<torch::nn::Module>> keep;
    for (int r = 0; r < p; ++r) {
      std::vector<PipelineChunk> chunks;
      for (int s : schedule.stages_of(r)) {
        auto module = make_chunk(s);
        module->to(dev);
        keep.push_back(module);
        chunks.push_back({s, module, [raw = module.get(), s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
      }
      pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks),
                                                     std::shared_ptr<Transport>(std::move(transports[r])), o));
    }
    torch::manual_seed(3);
    const auto inputs = torch::randn({m * kMicroBatchSize, kDim}).to(dev);
    const auto targets = torch::randn({m * kMicroBatchSize, kDim}).to(dev);
    std::vector<int> syncs(p, -1);
    std::vector<Transport*> transports_of;
    for (auto& pl : pipelines) transports_of.push_back(&pl->transport());
    std::atomic<int> warmed{0};
    run_rank_threads(
        transports_of,
        [&](Transport& t) {
          const int r = t.rank();
          const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
          c10::StreamGuard guard(impl->getStreamFromGlobalPool(dev));
          pipelines[r]->step(inputs, targets);  // warm-up: allocator, kernels, first-step checks
          pipelines[r]->ready_for_optimizer(0, NonFinitePolicy::kStop, 1.0);
          pipelines[r]->zero_grad();
          t.barrier(std::chrono::seconds(60));
          if (r == 0) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
          t.barrier(std::chrono::seconds(60));
          SyncCounter counter;
          {
            c10::WarningUtils::WarningHandlerGuard handler(&counter);
            pipelines[r]->step(inputs, targets);
            pipelines[r]->ready_for_optimizer(1, NonFinitePolicy::kStop, 1.0);
          }
          syncs[r] = counter.count;
          t.barrier(std::chrono::seconds(60));
          if (r == 0) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
          ++warmed;
        },
        /*abort_on_error=*/false)
        .rethrow_root_cause();
    ASSERT_EQ(warmed.load(), p);
    const int last = schedule.stage_to_rank.back();
    for (int r = 0; r < p; ++r) {
      // The timeline's event, the gradient check; the loss copy on the last stage's rank.
      const int documented = 2 + (r == last ? 1 : 0);
      EXPECT_LE(syncs[r], documented) << name << ": rank " << r << " synchronized " << syncs[r]
                                      << " times in a steady-state step (documented: " << documented << ")";
    }
  }
}

}  // namespace
}  // namespace twobp::testing
