// Uses the installed headers (through the umbrella header) and library: a 2BP split of one Linear layer must match
// ordinary backprop. Built with MPI and NCCL hidden from CMake: twobp::twobp needs neither.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdio>

#include "twobp/twobp.h"

int main() {
  auto layer = twobp::nn::Linear(4, 3);
  twobp::StageOptions options;
  options.stage_index = 1;
  options.loss = [](const at::Tensor& out, const at::Tensor&) { return out.sum(); };
  twobp::Stage stage(layer.ptr(), [&](const at::Tensor& x) { return layer->forward(x); }, options);
  const at::Tensor x = at::randn({2, 4});
  stage.forward(0, x, x);
  const at::Tensor grad_x = stage.backward_input(0);
  stage.backward_weight({0});
  // d(sum(xW^T + b))/dW = 1^T x, so every row of the weight gradient is the column sum of x.
  const bool ok = at::allclose(layer->weight.grad(), x.sum(0).expand({3, 4})) &&
                  at::allclose(grad_x, layer->weight.sum(0).expand({2, 4}));
  std::printf("twobp %s consumer: %s\n", TWOBP_VERSION_STRING, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
