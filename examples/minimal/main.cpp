// minimal: the smallest complete twobp program, the one to copy from. A 4-layer MLP learns y = sin(x0 + x1) in a
// 2-stage pipeline with 2BP (1F1B, the backward split into I and W), AdamW behind the optimizer gate.
//
//   minimal                                  # 2 ranks as threads of this process (Local transport)
//   torchrun --nproc-per-node 2 --no-python minimal   # one rank per process (TCPStore transport)
//
// run_ranks decides which: threads when no launcher started the process, the launcher's ranks otherwise.
// It needs only the core: twobp/core.h, linked against twobp::core (docs/ARCHITECTURE.md).
#include <torch/torch.h>
#include <twobp/core.h>

#include <cstdio>
#include <vector>
#include "twobp/schedule/registry.h"

int main() try {
  constexpr int kStages = 2, kMicroBatches = 4, kSteps = 60;
  // The whole model and data are built before any rank starts: torch::manual_seed and the default initialisers
  // use one process-wide generator, which rank threads must not share (each rank then takes its own stages).
  torch::manual_seed(0);
  std::vector<torch::nn::Sequential> stages;
  stages.emplace_back(torch::nn::Linear(2, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64), torch::nn::Tanh());
  stages.emplace_back(torch::nn::Linear(64, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  const at::Tensor inputs = torch::rand({kMicroBatches * 16, 2}) * 4 - 2;   // one batch of 64 samples
  const at::Tensor targets = torch::sin(inputs.sum(1, /*keepdim=*/true));

  twobp::RunRanksOptions launch;
  launch.thread_ranks = kStages;
  twobp::run_ranks(launch, [&](twobp::Transport& transport) {
    if (transport.world_size() != kStages) throw twobp::UsageError("minimal runs on exactly 2 ranks");
    auto schedule = twobp::make_schedule(
        "1f1b", twobp::default_schedule_options("1f1b", kStages, kMicroBatches, twobp::BackwardMode::kSplit));
    std::vector<twobp::PipelineChunk> chunks;
    for (int stage : schedule.stages_of(transport.rank())) {
      auto module = stages[stage];
      chunks.push_back({stage, module.ptr(), [module](const at::Tensor& x) mutable { return module->forward(x); }});
    }
    twobp::PipelineOptions options;
    options.loss = [](const at::Tensor& output, const at::Tensor& target) { return torch::mse_loss(output, target); };
    twobp::Pipeline pipeline(std::move(schedule), std::move(chunks), transport, options);
    torch::optim::AdamW optimizer(pipeline.parameters(), torch::optim::AdamWOptions(1e-2));

    for (int step = 0; step < kSteps; ++step) {
      // Inputs matter on the first stage, targets on the last; both are split into the micro-batches.
      const twobp::StepResult result = pipeline.step(inputs, targets);
      const double loss = pipeline.mean_loss(result);  // collective: every rank calls it
      // The gate: the global gradient norm over all ranks, clipped to 1; a NaN/Inf stops with an error.
      if (pipeline.ready_for_optimizer(step, twobp::NonFinitePolicy::kStop, /*max_norm=*/1.0)) optimizer.step();
      pipeline.zero_grad();
      const bool report = step % 10 == 0 || step == kSteps - 1;
      if (transport.rank() == 0 && report) std::printf("step %d loss %.4f\n", step, loss);
    }
  });
  return 0;
} catch (const std::exception& e) {  // run_ranks rethrows the root cause when a rank failed
  std::fprintf(stderr, "minimal: error: %s\n", e.what());
  return 1;
}
