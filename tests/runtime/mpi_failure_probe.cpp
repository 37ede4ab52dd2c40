// A 2-rank pipeline under mpiexec in which rank 1 fails on purpose, to prove that the job ends promptly with a
// message naming the failed rank instead of hanging. Mode (argv[1]):
//   throw   rank 1's chunk throws in its forward: the Pipeline aborts the MPI job naming rank 1
//   kill    rank 1 kills itself with SIGKILL mid-step: the launcher tears the job down
//   silent  rank 1 never calls step(): rank 0 times out (1 s) naming the RECV and the micro-batch, and its hang
//           report says rank 1 has not started the step
//   stuck   rank 1's second forward takes 4 s: rank 0 times out, and its hang report names rank 1's computation
//   dp      4 ranks, dp 2 x pp 2 with a ShardedOptimizer built from the pipeline: world rank 3 never joins the
//           optimizer's step after the first step (5 s); the rank that times out first (2 s) aborts the job with the
//           job-wide hang report, which names world rank 3 and the optimizer's broadcasts that wait for it
// Driven by check_mpi_failure.cmake, which asserts exit status, output and elapsed time.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "twobp/nn.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/transport/mpi.h"
#include "twobp/schedule/registry.h"

namespace {

// Every mode's pipeline: a mean-squared error over [2, 8] float activations, each wait bounded by `timeout`.
twobp::PipelineOptions probe_options(twobp::Duration timeout) {
  twobp::PipelineOptions options;
  options.executor.timeout = timeout;
  options.loss = [](const at::Tensor& out, const at::Tensor& target) { return (out - target).pow(2).mean(); };
  options.executor.activation_spec = [](int) { return twobp::TensorSpec{{2, 8}, at::kFloat}; };
  return options;
}

// Mode dp (see the top of this file). Returns the process's exit status when the job was not aborted.
int run_data_parallel(twobp::MpiEnvironment& env) {
  twobp::MpiTransport world(env);
  twobp::ParallelGroups groups(world, 2, std::chrono::seconds(30));
  const int me = env.rank(), stage = groups.pipeline().rank();
  auto schedule = twobp::make_schedule("1f1b", {2, 4, 1, twobp::BackwardMode::kSplit});
  auto layer = twobp::nn::Linear(8, 8);
  {
    at::NoGradGuard no_grad;  // the replicas must start from the same parameters (the Pipeline checks)
    for (auto& p : layer->parameters()) p.fill_(0.1 * (stage + 1));
  }
  // 2 s: 4 processes on as few as 2 cores, under ASan too.
  twobp::PipelineOptions options = probe_options(std::chrono::seconds(2));
  options.data_parallel.group = groups.data_parallel();
  twobp::Pipeline pipeline(schedule, {{stage, layer.ptr(), [&](const at::Tensor& x) { return layer->forward(x); }}},
                           groups.pipeline(), options);
  twobp::ShardedOptimizer optimizer(pipeline, [](std::vector<at::Tensor> owned) {
    return std::make_unique<torch::optim::SGD>(std::move(owned), torch::optim::SGDOptions(0.01));
  });
  const at::Tensor inputs = at::ones({8, 8}), targets = at::zeros({8, 8});
  try {
    for (int step = 0; step < 2; ++step) {
      pipeline.zero_grad();
      pipeline.step(inputs, targets);
      pipeline.ready_for_optimizer(step, twobp::NonFinitePolicy::kStop);
      if (me == 3) {
        std::this_thread::sleep_for(std::chrono::seconds(5));
        return 0;
      }
      optimizer.step();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: failed: %s\n", me, e.what());
    return 3;
  }
  return 0;
}

int run_main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "throw";
  twobp::MpiEnvironment env(&argc, &argv);
  if (mode == "dp") return run_data_parallel(env);
  auto schedule = twobp::make_schedule("1f1b", {2, 4, 1, twobp::BackwardMode::kSplit});
  auto layer = twobp::nn::Linear(8, 8);
  const int me = env.rank();
  const twobp::PipelineOptions options = probe_options(std::chrono::seconds(1));
  auto forward = [&, me](const at::Tensor& x) {
    if (me == 1 && mode == "throw") throw std::runtime_error("injected failure in the forward of rank 1");
    if (me == 1 && mode == "kill") std::raise(SIGKILL);
    static int calls = 0;
    if (me == 1 && mode == "stuck" && calls++ == 1) std::this_thread::sleep_for(std::chrono::seconds(4));
    return layer->forward(x);
  };
  twobp::Pipeline pipeline(schedule, {{me, layer.ptr(), forward}}, std::make_shared<twobp::MpiTransport>(env),
                           options);
  if (me == 1 && mode == "silent") {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    return 0;
  }
  try {
    pipeline.step(at::randn({8, 8}), at::randn({8, 8}));
  } catch (const std::exception& e) {
    // Reached only when the transport did not abort the job itself (the timeout case on rank 0).
    std::fprintf(stderr, "rank %d: step failed: %s\n", me, e.what());
    return 3;
  }
  std::printf("rank %d: step finished\n", me);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { twobp::exit_without_teardown(run_main(argc, argv)); }
