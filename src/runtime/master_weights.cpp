#include "runtime/master_weights.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "twobp/autograd/weight_grad_store.h"
#include "twobp/error.h"
#include "util/check.h"

namespace twobp::detail {

MasterWeights::MasterWeights(const std::map<int, std::shared_ptr<torch::nn::Module>>& modules,
                             at::ScalarType compute_dtype, int rank)
    : rank_(rank) {
  for (const auto& [stage, module] : modules) {
    for (const auto& item : module->named_parameters()) {
      const at::Tensor& p = item.value();
      if (!p.requires_grad() || by_compute_.count(p.unsafeGetTensorImpl()) != 0) continue;
      TWOBP_CHECK(p.scalar_type() == at::kFloat, UsageError,
                  "rank {} stage {}: mixed precision makes float32 masters of the chunks' parameters, but '{}' is {}: "
                  "build the chunks in float32 (the pipeline converts them to {})",
                  rank, stage, item.key(), c10::toString(p.scalar_type()), c10::toString(compute_dtype));
      TWOBP_CHECK(torch::autograd::impl::post_acc_grad_hooks(p) == nullptr, UsageError,
                  "rank {} stage {}: parameter '{}' has a post-accumulate-grad hook; mixed precision needs that slot "
                  "to move its gradients to the float32 master (register the hook on the master instead: "
                  "Pipeline::master_weight)",
                  rank, stage, item.key());
      Entry e;
      e.stage = stage;
      e.name = item.key();
      e.compute = p;
      e.master = p.detach().clone();
      e.master.set_requires_grad(true);
      by_compute_.emplace(p.unsafeGetTensorImpl(), entries_.size());
      entries_.push_back(std::move(e));
    }
  }
  for (const auto& [stage, module] : modules) module->to(compute_dtype);
  for (Entry& e : entries_) {
    e.version = static_cast<std::int64_t>(e.compute._version());
    autograd::set_master_gradient(e.compute, e.master);
  }
}

at::Tensor MasterWeights::master_of(const at::Tensor& t) const {
  auto it = by_compute_.find(t.unsafeGetTensorImpl());
  return it == by_compute_.end() ? t : entries_[it->second].master;
}

void MasterWeights::sync() {
  // Every master, every step: an optimizer may write a master through .data(), which a version counter does not
  // see, and a stale compute weight would be silently wrong. The copy costs one pass over the weights.
  // A write to a compute parameter (a checkpoint or an initialisation loaded into the chunk, an optimizer built
  // over the chunk's own parameters) would be overwritten here without a trace: refuse it instead. Writes through
  // .data() or set_data() bump no version and are not seen.
  for (const Entry& e : entries_) {
    TWOBP_CHECK(static_cast<std::int64_t>(e.compute._version()) == e.version, UsageError,
                "rank {} stage {}: parameter '{}' (its {} compute copy) was written since the last step; with mixed "
                "precision the float32 master is the parameter and every step copies it over the compute copy, which "
                "would undo that write: write the master instead (Pipeline::master_weight(p); optimizers and "
                "checkpoints over Pipeline::parameters())",
                rank_, e.stage, e.name, c10::toString(e.compute.scalar_type()));
  }
  c10::AutoGradMode no_grad(false);
  for (Entry& e : entries_) {
    e.compute.detach().copy_(e.master);
    e.version = static_cast<std::int64_t>(e.compute._version());
  }
}

}  // namespace twobp::detail
