#include "twobp/runtime/sharded_optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/training_state.h"
#include "util/check.h"

namespace twobp {
namespace {

namespace ck = twobp::checkpoint;

// One flat buffer per (dtype, device) of a list of tensors: what one broadcast moves.
using GroupKey = std::pair<at::ScalarType, std::string>;

GroupKey key_of(const at::Tensor& t) { return {t.scalar_type(), t.device().str()}; }

// Broadcasts `tensors` (same shapes and dtypes on every replica; the root's values win) with one message per
// (dtype, device) group, and writes the received values back into them on the other replicas.
void broadcast_into(const std::vector<at::Tensor>& tensors, int root, Transport& group, Duration timeout) {
  std::map<GroupKey, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < tensors.size(); ++i) groups[key_of(tensors[i])].push_back(i);
  const bool mine = group.rank() == root;
  for (const auto& [key, members] : groups) {
    at::Tensor flat;
    if (mine) {
      std::vector<at::Tensor> pieces;
      for (std::size_t i : members) pieces.push_back(tensors[i].detach().reshape({-1}));
      flat = at::cat(pieces);
    } else {
      int64_t total = 0;
      for (std::size_t i : members) total += tensors[i].numel();
      flat = at::empty({total}, tensors[members.front()].options().requires_grad(false));
    }
    group.broadcast(flat, root, timeout);
    if (mine) continue;
    int64_t offset = 0;
    for (std::size_t i : members) {
      const at::Tensor& t = tensors[i];
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, Transport* group, const Factory& make,
                                   Duration timeout)
    : params_(std::move(params)), group_(group), timeout_(timeout) {
  if (group_ != nullptr) {
    replica_ = group_->rank();
    replicas_ = group_->world_size();
  }
  TWOBP_CHECK(static_cast<bool>(make), UsageError, "ShardedOptimizer (replica {}): no optimizer factory", replica_);
  // Greedy by size, largest first, to the replica with the fewest elements so far (ties: the lower index, so
  // every replica computes the same assignment from the same parameters).
  std::vector<std::size_t> order(params_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return params_[a].numel() > params_[b].numel(); });
  std::vector<int64_t> load(replicas_, 0);
  owner_.assign(params_.size(), -1);
  for (std::size_t i : order) {
    const at::Tensor& p = params_[i];
    TWOBP_CHECK(p.defined(), UsageError, "ShardedOptimizer (replica {}): parameter {} is undefined", replica_, i);
    TWOBP_CHECK(index_.emplace(p.unsafeGetTensorImpl(), i).second, UsageError,
                "ShardedOptimizer (replica {}): parameter {} is listed twice (pass each tensor once: "
                "Pipeline::parameters())",
                replica_, i);
    if (!p.requires_grad()) continue;
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = r;
    load[r] += p.numel();
  }
  std::vector<at::Tensor> owned;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (owner_[i] == replica_) owned.push_back(params_[i]);
  }
  if (!owned.empty()) local_ = make(std::move(owned));
}

ShardedOptimizer::ShardedOptimizer(Pipeline& pipeline, const Factory& make)
    : ShardedOptimizer(pipeline.parameters(), pipeline.options().data_parallel.group, make,
                       pipeline.options().executor.timeout) {
  pipeline_ = &pipeline;
}

ShardedOptimizer::~ShardedOptimizer() = default;

void ShardedOptimizer::collective(const char* what, const std::function<void()>& body) {
  if (pipeline_ != nullptr && replicas_ > 1) {
    pipeline_->run_collective(*group_, what, body);
  } else {
    body();
  }
}

int ShardedOptimizer::owner_of(const at::Tensor& param) const {
  const auto it = index_.find(param.unsafeGetTensorImpl());
  TWOBP_CHECK(it != index_.end(), UsageError,
              "ShardedOptimizer (replica {}): a tensor of shape [{}] is not one of the parameters it was built with",
              replica_, fmt::join(param.sizes(), ", "));
  return owner_[it->second];
}

void ShardedOptimizer::step() {
  // Ownership is fixed at construction; a parameter unfrozen since has no owner and would never be stepped.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    TWOBP_CHECK(owner_[i] >= 0 || !params_[i].requires_grad(), UsageError,
                "ShardedOptimizer (replica {}): parameter {} (shape [{}]) requires grad, but did not when this "
                "optimizer was built, so no replica owns it and it would never be stepped: set requires_grad "
                "before building the ShardedOptimizer, or build a new one (gathered_adamw_state and "
                "restore_adamw_state carry the AdamW state over)",
                replica_, i, fmt::join(params_[i].sizes(), ", "));
  }
  if (local_) local_->step();
  if (replicas_ == 1) return;
  c10::AutoGradMode no_grad(false);
  collective("the sharded optimizer's broadcasts", [&] {
    for (int r = 0; r < replicas_; ++r) {
      std::vector<at::Tensor> share;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (owner_[i] == r) share.push_back(params_[i]);
      }
      broadcast_into(share, r, *group_, timeout_);
    }
  });
}

void ShardedOptimizer::set_lr(double lr) {
  if (local_ == nullptr) return;  // a replica that owns no parameter
  for (auto& group : local_->param_groups()) group.options().set_lr(lr);
}

int64_t ShardedOptimizer::state_bytes() const {
  if (!local_) return 0;
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += static_cast<int64_t>(t.numel() * t.element_size());
  };
  for (const auto& [key, state] : local_->state()) {
    if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      add(s->exp_avg());
      add(s->exp_avg_sq());
      add(s->max_exp_avg_sq());
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      add(a->exp_avg());
      add(a->exp_avg_sq());
      add(a->max_exp_avg_sq());
    } else if (const auto* g = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      add(g->momentum_buffer());
    } else {
      TWOBP_CHECK(false, UsageError,
                  "ShardedOptimizer (replica {}): state_bytes() knows the state of AdamW, Adam and SGD only", replica_);
    }
  }
  return bytes;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedOptimizer::gathered_adamw_state(
    const std::vector<std::pair<std::string, at::Tensor>>& params) {
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(local_.get());
  TWOBP_CHECK(!local_ || adamw != nullptr, UsageError,
              "ShardedOptimizer (replica {}): gathered_adamw_state needs an AdamW local optimizer", replica_);
  if (adamw != nullptr) {
    for (const auto& g : adamw->param_groups()) {
      TWOBP_CHECK(!static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad(), UsageError,
                  "ShardedOptimizer (replica {}): gathering AdamW state with amsgrad is not supported", replica_);
    }
  }
  // Every parameter's (step, exp_avg, exp_avg_sq) from its owner: first the steps of each owner's share (0: not
  // stepped yet, no state), then the moments of those with state. AdamW allocates both moments like the parameter.
  std::vector<std::pair<std::string, at::Tensor>> out;
  c10::AutoGradMode no_grad(false);
  collective("the gathering of the sharded optimizer's state", [&] {
    for (int r = 0; r < replicas_; ++r) {
      std::vector<std::pair<std::string, at::Tensor>> share;
      for (const auto& [name, p] : params) {
        if (owner_of(p) == r) share.emplace_back(name, p);
      }
      if (share.empty()) continue;
      const bool mine = r == replica_;
      at::Tensor steps = at::zeros({static_cast<int64_t>(share.size())}, at::kLong);
      std::vector<at::Tensor> moments;  // exp_avg, exp_avg_sq per parameter with state, in share order
      if (mine) {
        for (std::size_t k = 0; k < share.size(); ++k) {
          const auto it = adamw->state().find(share[k].second.unsafeGetTensorImpl());
          if (it == adamw->state().end()) continue;
          const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
          steps[static_cast<int64_t>(k)] = s.step();
        }
      }
      if (replicas_ > 1) group_->broadcast(steps, r, timeout_);
      for (std::size_t k = 0; k < share.size(); ++k) {
        if (steps[static_cast<int64_t>(k)].item<int64_t>() == 0) continue;
        const at::Tensor& p = share[k].second;
        if (mine) {
          const auto& s =
              static_cast<const torch::optim::AdamWParamState&>(*adamw->state().at(p.unsafeGetTensorImpl()));
          moments.push_back(s.exp_avg().clone());
          moments.push_back(s.exp_avg_sq().clone());
        } else {
          moments.push_back(at::empty_like(p, p.options().requires_grad(false)));
          moments.push_back(at::empty_like(p, p.options().requires_grad(false)));
        }
      }
      if (replicas_ > 1) broadcast_into(moments, r, *group_, timeout_);
      std::size_t m = 0;
      for (std::size_t k = 0; k < share.size(); ++k) {
        const int64_t step = steps[static_cast<int64_t>(k)].item<int64_t>();
        if (step == 0) continue;
        const std::string& name = share[k].first;
        out.emplace_back(ck::optimizer_state_name(name, "step"), at::scalar_tensor(step, at::kLong));
        out.emplace_back(ck::optimizer_state_name(name, "exp_avg"), moments[m++]);
        out.emplace_back(ck::optimizer_state_name(name, "exp_avg_sq"), moments[m++]);
      }
    }
  });
  return out;
}

void ShardedOptimizer::restore_adamw_state(const std::vector<std::pair<std::string, at::Tensor>>& loaded,
                                           const std::vector<std::pair<std::string, at::Tensor>>& params) {
  ck::NamedTensors owned;
  for (const auto& [name, p] : params) {
    if (owner_of(p) == replica_) owned.emplace_back(name, p);
  }
  if (owned.empty()) return;
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(local_.get());
  TWOBP_CHECK(adamw != nullptr, UsageError,
              "ShardedOptimizer (replica {}): restore_adamw_state needs an AdamW local optimizer", replica_);
  // checkpoint::restore sets weights and state together; the weights are already in place (restored from the
  // same checkpoint, or current), so each owned parameter is given its own value.
  std::set<std::string> names;
  for (const auto& [name, p] : owned) names.insert(name);
  const auto wanted = ck::state_of(owned);
  ck::NamedTensors mine = owned;
  for (const auto& entry : loaded) {
    if (names.count(entry.first) == 0 && wanted(entry.first)) mine.push_back(entry);
  }
  ck::restore(mine, owned, adamw);
}

}  // namespace twobp
