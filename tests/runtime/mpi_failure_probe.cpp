// A 2-rank pipeline under mpiexec in which rank 1 fails on purpose, to prove that the job ends promptly with a
// message naming the failed rank instead of hanging. Mode (argv[1]):
//   throw   rank 1's chunk throws in its forward: the Pipeline aborts the MPI job naming rank 1
//   kill    rank 1 kills itself with SIGKILL mid-step: the launcher tears the job down
//   silent  rank 1 never calls step(): rank 0 times out (1 s) naming the RECV and the micro-batch, and its hang
//           report says rank 1 has not started the step
//   stuck   rank 1's second forward takes 4 s: rank 0 times out, and its hang report names rank 1's computation
// Driven by check_mpi_failure.cmake, which asserts exit status, output and elapsed time.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "twobp/nn.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/transport/mpi.h"
#include "twobp/schedule/registry.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "throw";
  twobp::MpiEnvironment env(&argc, &argv);
  auto schedule = twobp::make_schedule("1f1b", {2, 4, 1, twobp::BackwardMode::kSplit});
  auto layer = twobp::nn::Linear(8, 8);
  const int me = env.rank();
  twobp::PipelineOptions options;
  options.executor.timeout = std::chrono::seconds(1);
  options.loss = [](const at::Tensor& out, const at::Tensor& target) { return (out - target).pow(2).mean(); };
  options.executor.activation_spec = [](int) { return twobp::TensorSpec{{2, 8}, at::kFloat}; };
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
