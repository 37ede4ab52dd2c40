#pragma once
// Name-keyed initialisation of the library's reference models built from LibTorch layers (bert.h, resnet.h): each
// parameter drawn from a generator seeded by (seed, its name), so that a model's weights do not depend on the
// partition, the thread or the process that builds a chunk, and no rank thread touches the shared default
// generator.

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <cmath>
#include <string>

#include "util/hash.h"

namespace twobp::models::detail {

/// Weights of two or more dimensions ~ N(0, 1/fan_in) (fan_in: the elements per output row); other weights (the
/// norms' scales) 1; biases 0.
inline void init_by_name(torch::nn::Module& module, uint64_t seed) {
  c10::AutoGradMode no_grad(false);
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (bias || p.dim() < 2) {
      p.fill_(bias ? 0.0 : 1.0);
      continue;
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(twobp::detail::mix64(seed ^ twobp::detail::fnv1a(name)));
    p.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(p.numel() / p.size(0))), gen);
  }
}

}  // namespace twobp::models::detail
