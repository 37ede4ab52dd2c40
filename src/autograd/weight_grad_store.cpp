#include "twobp/autograd/weight_grad_store.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <fmt/ranges.h>

#include "util/check.h"

namespace twobp::autograd {
namespace {
thread_local WeightGradStore* t_store = nullptr;
thread_local std::int64_t t_micro_batch = 0;

// Inference tensors (e.g. token ids made under InferenceMode) have no version counter and cannot be modified
// in place outside InferenceMode anyway.
std::int64_t version_of(const at::Tensor& t) {
  return t.defined() && !t.is_inference() ? static_cast<std::int64_t>(t._version()) : -1;
}
}  // namespace

void check_no_gradient_hooks(const at::Tensor& param, const std::string& layer, const std::string& context) {
  if (!param.defined() || !param.requires_grad()) return;
  TWOBP_CHECK(torch::autograd::impl::hooks(param).empty(), UsageError,
              "{}: a parameter of fast-path layer {} (shape [{}]) has a gradient hook (register_hook); twobp::nn "
              "layers compute weight gradients outside autograd and cannot run it as loss.backward() would. Use "
              "the LibTorch layer (torch::nn::{}, general path, which runs parameter hooks) for this parameter, a "
              "post-accumulate-grad hook (supported), or change .grad after the step",
              context, layer, fmt::join(param.sizes(), ", "), layer);
}

namespace {

// The hook set_master_gradient installs: moves what autograd accumulated into the compute parameter's .grad (one
// micro-batch's, from general-path layers) into the master's, so that gradients accumulate in float32.
struct MasterGradientHook : torch::autograd::PostAccumulateGradHook {
  explicit MasterGradientHook(at::Tensor master) : master(std::move(master)) {}
  void operator()(const torch::autograd::Variable& compute) override {
    at::Tensor& g = const_cast<torch::autograd::Variable&>(compute).mutable_grad();
    if (!g.defined()) return;
    at::Tensor moved = std::move(g);
    g.reset();
    accumulate_grad(compute, moved);  // into the master's .grad (gradient_holder)
  }
  at::Tensor master;
};

const MasterGradientHook* master_hook(const at::Tensor& p) {
  if (!p.defined() || !p.requires_grad()) return nullptr;
  return dynamic_cast<const MasterGradientHook*>(torch::autograd::impl::post_acc_grad_hooks(p).get());
}

// A user's post-accumulate-grad hook (the master hook is part of the accumulation, see set_master_gradient).
bool has_post_accumulate_hook(const at::Tensor& p) {
  return p.defined() && p.requires_grad() && torch::autograd::impl::post_acc_grad_hooks(p) != nullptr &&
         master_hook(p) == nullptr;
}

bool has_hooked_parameter(const WeightGradKernel* kernel) {
  for (const auto& p : kernel->weight_grad_parameters()) {
    if (has_post_accumulate_hook(p)) return true;
  }
  return false;
}

void fire_post_accumulate_hook(const at::Tensor& p) {
  if (auto& hook = torch::autograd::impl::post_acc_grad_hooks(p)) (*hook)(p);
}

[[noreturn]] void refuse_shared_hooked(const std::string& context, const at::Tensor& p, const WeightGradKernel* k) {
  detail::raise<UsageError>(
      "{}: a parameter (shape [{}]) of fast-path layer {} that ordinary ops use too has a post-accumulate-grad "
      "hook; autograd and the fast path would each fire it. Use the LibTorch layer (torch::nn::{}) for it, or "
      "hook only parameters used by one kind of layer",
      context, fmt::join(p.sizes(), ", "), k->kernel_name(), k->kernel_name());
}

}  // namespace

WeightGradStore::WeightGradStore() : anchor_(at::empty({0}).set_requires_grad(true)) {}

void WeightGradStore::on_backward(std::int64_t micro_batch, const WeightGradKernel* kernel, WeightGradItem item) {
  if (policy() == WeightGradPolicy::kImmediate) {
    kernel->accumulate_weight_grad({item});
    if (has_hooked_parameter(kernel)) {
      std::lock_guard<std::mutex> lock(mutex_);  // autograd may run this on a device thread
      immediate_hooked_.push_back(kernel);
    }
    return;
  }
  const std::int64_t input_version = version_of(item.input), grad_version = version_of(item.grad_output);
  std::lock_guard<std::mutex> lock(mutex_);
  queue_[micro_batch].push_back(Entry{kernel, std::move(item), input_version, grad_version});
}

void WeightGradStore::fire_immediate_hooks() {
  std::vector<const WeightGradKernel*> kernels;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    kernels.swap(immediate_hooked_);
  }
  std::unordered_map<const c10::TensorImpl*, at::Tensor> fired;
  for (const auto* k : kernels) {
    for (const auto& p : k->weight_grad_parameters()) {
      if (!has_post_accumulate_hook(p) || !fired.emplace(p.unsafeGetTensorImpl(), p).second) continue;
      // A grad accumulator exists while a live graph uses the tensor through ordinary ops: AccumulateGrad has
      // fired (or will fire) the hook for that use.
      if (torch::autograd::impl::try_get_grad_accumulator(p) != nullptr) refuse_shared_hooked(context_, p, k);
      fire_post_accumulate_hook(p);
    }
  }
}

std::vector<WeightGradStore::Entry> WeightGradStore::take_entries(c10::ArrayRef<std::int64_t> micro_batches) {
  std::vector<Entry> entries;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Check first, so that a refused W leaves the queue as it was.
    for (std::int64_t mb : micro_batches) {
      auto it = queue_.find(mb);
      if (it == queue_.end()) continue;
      for (const auto& e : it->second) {
        for (auto [t, saved, what] : {std::tuple{&e.item.input, e.input_version, "input"},
                                      std::tuple{&e.item.grad_output, e.grad_version, "output gradient"}}) {
          const std::int64_t now = version_of(*t);
          TWOBP_CHECK(saved < 0 || now == saved, UsageError,
                      "{} micro-batch {}: the {} that {} saved in I for W was modified by an in-place operation "
                      "between I and W (version {} -> {}); its weight gradient would be wrong. Modify a copy "
                      "(clone()) instead, or run W before the modification",
                      context_, mb, what, e.kernel->kernel_name(), saved, now);
        }
      }
    }
    for (std::int64_t mb : micro_batches) {
      auto it = queue_.find(mb);
      if (it == queue_.end()) continue;
      for (auto& e : it->second) {
        e.micro_batch = mb;
        entries.push_back(std::move(e));
      }
      queue_.erase(it);
    }
  }
  return entries;
}

void WeightGradStore::run(c10::ArrayRef<std::int64_t> micro_batches, bool batched, const ParametersDone& done,
                          const std::vector<at::Tensor>& general_leaves) {
  std::vector<Entry> entries = take_entries(micro_batches);
  c10::AutoGradMode no_grad(false);
  // The kernel calls of this run, in order: one per layer over all its items (batched; grouped in first-seen
  // order, so a layer used several times -- tied weights, several micro-batches -- is one concatenated GEMM),
  // or one per item.
  // With post-accumulate-grad hooks, the calls go micro-batch by micro-batch, and after the last call of a
  // micro-batch that writes a hooked parameter the hook fires (once, however many layers share the tensor).
  bool hooked = false;
  for (const auto& e : entries) hooked = hooked || has_hooked_parameter(e.kernel);
  if (hooked) {
    std::unordered_set<const c10::TensorImpl*> general;
    for (const auto& t : general_leaves) general.insert(t.unsafeGetTensorImpl());
    for (const auto& e : entries) {
      for (const auto& p : e.kernel->weight_grad_parameters()) {
        if (has_post_accumulate_hook(p) && general.count(p.unsafeGetTensorImpl()) != 0) {
          refuse_shared_hooked(context_, p, e.kernel);
        }
      }
    }
  }
  std::vector<std::pair<const WeightGradKernel*, std::vector<WeightGradItem>>> calls;
  std::vector<std::vector<at::Tensor>> fire_after;  // by call: hooked parameters whose micro-batch ends there
  auto group_into_calls = [&](std::vector<Entry>& group) {
    std::unordered_map<const WeightGradKernel*, std::size_t> slot;
    for (auto& e : group) {
      auto [it, inserted] = slot.try_emplace(e.kernel, calls.size());
      if (inserted || !batched) {
        if (!inserted) it->second = calls.size();
        calls.emplace_back(e.kernel, std::vector<WeightGradItem>{});
      }
      calls[it->second].second.push_back(std::move(e.item));
    }
  };
  if (!hooked) {
    group_into_calls(entries);
    fire_after.resize(calls.size());
  } else {
    for (std::int64_t mb : micro_batches) {
      std::vector<Entry> group;
      for (auto& e : entries) {
        if (e.micro_batch == mb) group.push_back(std::move(e));
      }
      const std::size_t first = calls.size();
      group_into_calls(group);
      fire_after.resize(calls.size());
      std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, at::Tensor>> last;
      for (std::size_t c = first; c < calls.size(); ++c) {
        for (const auto& p : calls[c].first->weight_grad_parameters()) {
          if (has_post_accumulate_hook(p)) last.insert_or_assign(p.unsafeGetTensorImpl(), std::make_pair(c, p));
        }
      }
      for (auto& [impl, at_call] : last) fire_after[at_call.first].push_back(at_call.second);
    }
  }
  // For `done`: the last call writing each parameter (by identity); nothing is reported when a kernel does not
  // say what it writes, since it might write anything.
  std::vector<std::vector<at::Tensor>> finished(calls.size());
  if (done) {
    std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, at::Tensor>> last;
    bool known = true;
    for (std::size_t c = 0; c < calls.size() && known; ++c) {
      const auto params = calls[c].first->weight_grad_parameters();
      known = !params.empty();
      for (const auto& p : params) {
        if (p.defined()) last.insert_or_assign(p.unsafeGetTensorImpl(), std::make_pair(c, p));
      }
    }
    if (known) {
      for (auto& [impl, at_call] : last) finished[at_call.first].push_back(at_call.second);
    }
  }
  for (std::size_t c = 0; c < calls.size(); ++c) {
    calls[c].first->accumulate_weight_grad(calls[c].second);
    for (const auto& p : fire_after[c]) fire_post_accumulate_hook(p);
    if (!finished[c].empty()) done(finished[c]);
  }
}

std::size_t WeightGradStore::pending(std::int64_t micro_batch) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queue_.find(micro_batch);
  return it == queue_.end() ? 0 : it->second.size();
}

std::int64_t WeightGradStore::pending_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::int64_t bytes = 0;
  for (const auto& [mb, entries] : queue_) {
    for (const auto& e : entries) {
      bytes += e.item.input.defined() ? static_cast<std::int64_t>(e.item.input.nbytes()) : 0;
      bytes += e.item.grad_output.defined() ? static_cast<std::int64_t>(e.item.grad_output.nbytes()) : 0;
    }
  }
  return bytes;
}

void WeightGradStore::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
  immediate_hooked_.clear();
}

RecordingScope::RecordingScope(WeightGradStore& store, std::int64_t micro_batch)
    : previous_store_(t_store), previous_micro_batch_(t_micro_batch) {
  t_store = &store;
  t_micro_batch = micro_batch;
}

RecordingScope::~RecordingScope() {
  t_store = previous_store_;
  t_micro_batch = previous_micro_batch_;
}

WeightGradStore* current_store() { return t_store; }
std::int64_t current_micro_batch() { return t_micro_batch; }

void set_master_gradient(const at::Tensor& param, const at::Tensor& master) {
  TWOBP_CHECK(torch::autograd::impl::post_acc_grad_hooks(param) == nullptr, UsageError,
              "set_master_gradient: the parameter (shape [{}]) already has a post-accumulate-grad hook; a tensor has "
              "one slot (register the hook on its master instead)",
              fmt::join(param.sizes(), ", "));
  torch::autograd::impl::set_post_acc_grad_hooks(param, std::make_unique<MasterGradientHook>(master));
}

at::Tensor gradient_holder(const at::Tensor& param) {
  const MasterGradientHook* hook = master_hook(param);
  return hook != nullptr ? hook->master : param;
}

void accumulate_grad(const at::Tensor& param, const at::Tensor& grad, bool fresh) {
  c10::AutoGradMode no_grad(false);
  const at::Tensor holder = gradient_holder(param);
  at::Tensor& slot = const_cast<at::Tensor&>(holder).mutable_grad();
  if (!slot.defined()) {
    // A fresh result becomes .grad as it is, whatever its strides (a matrix product's transposed view): copying
    // it into a contiguous tensor costs as much as a small GEMM. Later accumulations add into it in place.
    if (grad.scalar_type() != holder.scalar_type()) {
      slot = grad.to(holder.scalar_type());
    } else {
      slot = fresh ? grad : grad.clone();
    }
  } else if (slot.is_sparse() && !grad.is_sparse()) {
    slot = grad + slot;  // a sparse .grad cannot absorb a dense gradient in place (AccumulateGrad does the same)
  } else if (grad.is_sparse() && grad.scalar_type() != slot.scalar_type()) {
    slot.add_(grad.to(slot.scalar_type()));
  } else {
    slot.add_(grad);  // converts a dense bfloat16 gradient on the fly into a float32 .grad: one kernel
  }
}

void accumulate_matmul(const at::Tensor& param, const at::Tensor& a, const at::Tensor& b) {
  c10::AutoGradMode no_grad(false);
  const at::Tensor holder = gradient_holder(param);
  at::Tensor& slot = const_cast<at::Tensor&>(holder).mutable_grad();
  const bool same = holder.scalar_type() == a.scalar_type();
  // A bfloat16/float16 product into a float32 gradient, written by the GEMM in float32 (CUDA only in LibTorch).
  const bool widen = !same && a.is_cuda() && holder.scalar_type() == at::kFloat &&
                     at::isReducedFloatingType(a.scalar_type());
  if (!slot.defined()) {
    slot = widen ? at::mm(a, b, at::kFloat) : at::mm(a, b);
    if (!widen && !same) slot = slot.to(holder.scalar_type());
  } else if (slot.is_sparse() || slot.dim() != 2 || !(same || widen)) {
    accumulate_grad(param, at::mm(a, b));
  } else if (same) {
    slot.addmm_(a, b);  // beta = 1: the GEMM adds into .grad
  } else {
    // baddbmm's out_dtype form accumulates into its float32 output (beta = 1); mm's has no beta.
    at::Tensor out = slot.unsqueeze(0);
    at::baddbmm_out(out, out, a.unsqueeze(0), b.unsqueeze(0), at::kFloat);
  }
}

}  // namespace twobp::autograd
