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
#include <unordered_map>

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
  assign_owners(make);
}

void ShardedOptimizer::assign_owners(const Factory& make) {
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
    : params_(pipeline.parameters()),
      group_(pipeline.options().data_parallel.group),
      pipeline_(&pipeline),
      timeout_(pipeline.options().executor.timeout) {
  if (group_ != nullptr) {
    replica_ = group_->rank();
    replicas_ = group_->world_size();
  }
  TWOBP_CHECK(static_cast<bool>(make), UsageError, "ShardedOptimizer (replica {}): no optimizer factory", replica_);
  zero2_ = pipeline.zero_stage() == ZeroStage::k2 && replicas_ > 1;
  if (!zero2_) {
    assign_owners(make);
    return;
  }
  // ZeRO-2: every replica steps its shard of every bucket; nobody owns a whole parameter (owner_ stays -1).
  for (std::size_t i = 0; i < params_.size(); ++i) index_.emplace(params_[i].unsafeGetTensorImpl(), i);
  owner_.assign(params_.size(), -1);
  std::vector<at::Tensor> shards = pipeline.parameter_shards();
  if (!shards.empty()) local_ = make(std::move(shards));
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
  if (zero2_) {
    // The shards are the working weights' (masters') storage: stepping them updates this replica's part in place;
    // the all-gather brings the others' parts.
    if (local_) local_->step();
    pipeline_->gather_parameter_shards();
    return;
  }
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
  bytes_sent_ = 0;
  if (replicas_ == 1) return;
  c10::AutoGradMode no_grad(false);
  for (const auto& p : params_) {
    if (p.requires_grad()) {
      bytes_sent_ += collective_bytes_sent(CollectiveKind::kBroadcast, p.numel() * p.element_size(), replicas_);
    }
  }
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

namespace {

// ZeRO-2: the local AdamW over the pipeline's shards, refused otherwise (also with amsgrad, as ZeRO-1's gathering).
torch::optim::AdamW& zero2_adamw(torch::optim::Optimizer* local, int replica, const char* what) {
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(local);
  TWOBP_CHECK(adamw != nullptr, UsageError, "ShardedOptimizer (replica {}): {} needs an AdamW local optimizer",
              replica, what);
  for (const auto& g : adamw->param_groups()) {
    TWOBP_CHECK(!static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad(), UsageError,
                "ShardedOptimizer (replica {}): {} with amsgrad is not supported", replica, what);
  }
  return *adamw;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> ShardedOptimizer::gathered_zero2_state(
    const std::vector<std::pair<std::string, at::Tensor>>& params) {
  torch::optim::AdamW& adamw = zero2_adamw(local_.get(), replica_, "gathered_adamw_state");
  const std::vector<at::Tensor> shards = pipeline_->parameter_shards();
  // Every shard is stepped together (one step count for all: each step gives every shard a gradient); none yet:
  // no state, as for a parameter never stepped.
  int64_t step = 0;
  for (const auto& shard : shards) {
    const auto it = adamw.state().find(shard.unsafeGetTensorImpl());
    if (it != adamw.state().end()) step = static_cast<const torch::optim::AdamWParamState&>(*it->second).step();
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (step == 0) return out;
  // Each parameter's moments in its own shape, this replica's slices filled and the rest zero; the sum over the
  // replicas (disjoint slices: x + 0 is exact) is the whole state, by the parameter's global name.
  std::unordered_map<const c10::TensorImpl*, std::size_t> by_holder;  // -> index in params
  std::vector<at::Tensor> avg, sq;
  c10::AutoGradMode no_grad(false);
  for (std::size_t k = 0; k < params.size(); ++k) {
    by_holder.emplace(params[k].second.unsafeGetTensorImpl(), k);
    avg.push_back(at::zeros_like(params[k].second, params[k].second.options().requires_grad(false)));
    sq.push_back(at::zeros_like(params[k].second, params[k].second.options().requires_grad(false)));
  }
  for (const ParameterShardSlice& slice : pipeline_->parameter_shard_layout()) {
    const auto found = by_holder.find(slice.parameter.unsafeGetTensorImpl());
    TWOBP_CHECK(found != by_holder.end(), UsageError,
                "ShardedOptimizer (replica {}): a trained parameter of shape [{}] is not among the named parameters "
                "given to gathered_adamw_state (name every Pipeline::parameters() tensor)",
                replica_, fmt::join(slice.parameter.sizes(), ", "));
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(
        *adamw.state().at(shards[slice.shard].unsafeGetTensorImpl()));
    const std::size_t k = found->second;
    avg[k].view({-1}).narrow(0, slice.param_offset, slice.numel).copy_(
        st.exp_avg().narrow(0, slice.shard_offset, slice.numel));
    sq[k].view({-1}).narrow(0, slice.param_offset, slice.numel).copy_(
        st.exp_avg_sq().narrow(0, slice.shard_offset, slice.numel));
  }
  collective("the gathering of the ZeRO-2 optimizer state", [&] {
    for (std::size_t k = 0; k < params.size(); ++k) {
      group_->all_reduce_sum(avg[k], timeout_);
      group_->all_reduce_sum(sq[k], timeout_);
    }
  });
  for (std::size_t k = 0; k < params.size(); ++k) {
    if (!params[k].second.requires_grad()) continue;
    const std::string& name = params[k].first;
    out.emplace_back(ck::optimizer_state_name(name, "step"), at::scalar_tensor(step, at::kLong));
    out.emplace_back(ck::optimizer_state_name(name, "exp_avg"), avg[k]);
    out.emplace_back(ck::optimizer_state_name(name, "exp_avg_sq"), sq[k]);
  }
  return out;
}

void ShardedOptimizer::restore_zero2_state(const std::vector<std::pair<std::string, at::Tensor>>& loaded,
                                           const std::vector<std::pair<std::string, at::Tensor>>& params) {
  torch::optim::AdamW& adamw = zero2_adamw(local_.get(), replica_, "restore_adamw_state");
  std::unordered_map<std::string, at::Tensor> by_name(loaded.begin(), loaded.end());
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& [name, p] : params) name_of.emplace(p.unsafeGetTensorImpl(), name);
  const std::vector<at::Tensor> shards = pipeline_->parameter_shards();
  std::vector<at::Tensor> avg, sq;
  for (const auto& shard : shards) {
    avg.push_back(at::zeros_like(shard, shard.options().requires_grad(false)));
    sq.push_back(at::zeros_like(shard, shard.options().requires_grad(false)));
  }
  auto field = [&](const std::string& name, const char* what) -> const at::Tensor& {
    const auto it = by_name.find(ck::optimizer_state_name(name, what));
    TWOBP_CHECK(it != by_name.end(), UsageError,
                "ShardedOptimizer (replica {}): the loaded state has no '{}' for parameter '{}' (a checkpoint of "
                "another model, or saved before its first step)",
                replica_, what, name);
    return it->second;
  };
  int64_t step = -1;
  c10::AutoGradMode no_grad(false);
  for (const ParameterShardSlice& slice : pipeline_->parameter_shard_layout()) {
    const auto named = name_of.find(slice.parameter.unsafeGetTensorImpl());
    TWOBP_CHECK(named != name_of.end(), UsageError,
                "ShardedOptimizer (replica {}): a trained parameter of shape [{}] is not among the named parameters "
                "given to restore_adamw_state",
                replica_, fmt::join(slice.parameter.sizes(), ", "));
    const std::string& name = named->second;
    const int64_t s = field(name, "step").item<int64_t>();
    TWOBP_CHECK(step < 0 || s == step, UsageError,
                "ShardedOptimizer (replica {}): the loaded state's step counts differ ({} and {} for '{}'); ZeRO-2 "
                "steps all parameters together",
                replica_, step, s, name);
    step = s;
    for (auto [what, into] : {std::make_pair("exp_avg", &avg), std::make_pair("exp_avg_sq", &sq)}) {
      const at::Tensor& full = field(name, what);
      TWOBP_CHECK(full.numel() == slice.parameter.numel(), UsageError,
                  "ShardedOptimizer (replica {}): '{}' of '{}' has {} elements, the parameter {}", replica_, what,
                  name, full.numel(), slice.parameter.numel());
      (*into)[slice.shard].narrow(0, slice.shard_offset, slice.numel).copy_(
          full.reshape({-1}).narrow(0, slice.param_offset, slice.numel));
    }
  }
  if (step < 0) return;  // this replica's shards are all empty: nothing to hold (the others restore theirs)
  for (std::size_t k = 0; k < shards.size(); ++k) {
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(step);
    state->exp_avg(avg[k]);
    state->exp_avg_sq(sq[k]);
    adamw.state()[shards[k].unsafeGetTensorImpl()] = std::move(state);
  }
}

std::vector<std::pair<std::string, at::Tensor>> ShardedOptimizer::gathered_adamw_state(
    const std::vector<std::pair<std::string, at::Tensor>>& params) {
  if (zero2_) return gathered_zero2_state(params);
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
  if (zero2_) {
    restore_zero2_state(loaded, params);
    return;
  }
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

ReplicaMemory replica_memory(const Pipeline& pipeline, const ShardedOptimizer& optimizer) {
  ReplicaMemory m = pipeline.replica_memory();
  m.optimizer_state = optimizer.state_bytes();
  m.bytes_sent += optimizer.bytes_sent();
  return m;
}

}  // namespace twobp
