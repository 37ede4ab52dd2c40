#include "twobp/runtime/training_state.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <cstring>
#include <memory>
#include <set>
#include <unordered_map>

#include "util/check.h"

namespace twobp::checkpoint {

std::function<bool(const std::string&)> state_of(const NamedTensors& params) {
  std::set<std::string> names;
  for (const auto& [name, t] : params) names.insert(name);
  return [names = std::move(names)](const std::string& tensor) {
    if (names.count(tensor) != 0) return true;
    // optimizer_state_name(name, field): <name> may itself contain dots, <field> does not.
    const std::size_t prefix = std::strlen(kOptimizerPrefix);
    if (tensor.rfind(kOptimizerPrefix, 0) != 0) return false;
    const std::size_t dot = tensor.rfind('.');
    return dot > prefix && names.count(tensor.substr(prefix, dot - prefix)) != 0;
  };
}

std::string optimizer_state_name(const std::string& parameter, const std::string& field) {
  return kOptimizerPrefix + parameter + "." + field;
}

NamedTensors module_tensors(const torch::nn::Module& module, const std::string& prefix) {
  NamedTensors out;
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(prefix + item.key(), item.value());
  }
  return out;
}

NamedTensors adamw_state_tensors(const torch::optim::AdamW& optimizer, const NamedTensors& params) {
  NamedTensors out;
  const auto& state = optimizer.state();
  for (const auto& [name, p] : params) {
    auto it = state.find(p.unsafeGetTensorImpl());
    if (it == state.end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.emplace_back(optimizer_state_name(name, "step"), at::scalar_tensor(s.step(), at::kLong));
    out.emplace_back(optimizer_state_name(name, "exp_avg"), s.exp_avg());
    out.emplace_back(optimizer_state_name(name, "exp_avg_sq"), s.exp_avg_sq());
    if (s.max_exp_avg_sq().defined()) {
      out.emplace_back(optimizer_state_name(name, "max_exp_avg_sq"), s.max_exp_avg_sq());
    }
  }
  return out;
}

void restore(const NamedTensors& loaded, const NamedTensors& params, torch::optim::AdamW* optimizer) {
  std::unordered_map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : loaded) by_name.emplace(name, &t);
  std::set<std::string> used;
  auto find = [&](const std::string& name) -> const at::Tensor* {
    auto it = by_name.find(name);
    if (it == by_name.end()) return nullptr;
    used.insert(name);
    return it->second;
  };
  // A copy, always: the optimizer's steps update its state in place, and must not change the caller's `loaded`.
  auto like = [](const at::Tensor& src, const at::Tensor& ref) {
    return src.to(ref.device(), ref.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  };

  at::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    const at::Tensor* src = find(name);
    TWOBP_CHECK(src != nullptr, UsageError,
                "checkpoint: parameter '{}' is not in the checkpoint (another model or partition?)", name);
    TWOBP_CHECK(src->sizes() == p.sizes(), UsageError,
                "checkpoint: parameter '{}' has shape [{}] in the checkpoint but [{}] in the model", name,
                fmt::join(src->sizes(), ", "), fmt::join(p.sizes(), ", "));
    TWOBP_CHECK(src->scalar_type() == p.scalar_type(), UsageError,
                "checkpoint: parameter '{}' is {} in the checkpoint but {} in the model", name,
                c10::toString(src->scalar_type()), c10::toString(p.scalar_type()));
    p.copy_(*src);
    if (optimizer == nullptr) continue;
    const at::Tensor* step = find(optimizer_state_name(name, "step"));
    if (step == nullptr) continue;
    const at::Tensor* m1 = find(optimizer_state_name(name, "exp_avg"));
    const at::Tensor* m2 = find(optimizer_state_name(name, "exp_avg_sq"));
    TWOBP_CHECK(m1 && m2, UsageError, "checkpoint: optimizer state of '{}' is incomplete", name);
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step->item<int64_t>());
    s->exp_avg(like(*m1, p));
    s->exp_avg_sq(like(*m2, p));
    if (const at::Tensor* m3 = find(optimizer_state_name(name, "max_exp_avg_sq"))) s->max_exp_avg_sq(like(*m3, p));
    optimizer->state()[p.unsafeGetTensorImpl()] = std::move(s);
  }
  for (const auto& [name, t] : loaded) {
    if (optimizer == nullptr && name.rfind(kOptimizerPrefix, 0) == 0) continue;  // optimizer state not wanted
    TWOBP_CHECK(used.count(name), UsageError,
                "checkpoint: tensor '{}' in the checkpoint matches no parameter of this rank (another partition?)",
                name);
  }
}

}  // namespace twobp::checkpoint
