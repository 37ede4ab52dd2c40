#include "runtime/gradient_reducer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <unordered_map>

#include "util/check.h"
#include "util/format.h"
#include "util/time.h"

namespace twobp::detail {

GradientReducer::GradientReducer(const Schedule& schedule, int rank, const std::map<int, Stage*>& stages,
                                 DataParallelOptions options, Duration timeout, const GradientHolder& holder)
    : rank_(rank), options_(options), timeout_(timeout), dp_(options.group->world_size()), stages_(stages) {
  // WHY no early start on a blocking transport: a reduction started inside the action stream would block there
  // until the other replicas reach it, coupling their pipelines; with skew in opposite directions two replicas
  // could each wait for a rank that waits for the other. Started after the last action, nothing can interleave.
  options_.overlap = options_.overlap && options_.group->asynchronous_all_reduce();
  TWOBP_CHECK(options_.bucket_bytes > 0 && options_.first_bucket_bytes > 0, UsageError,
              "rank {}: DataParallelOptions::bucket_bytes and first_bucket_bytes must be > 0, got {} and {}", rank_,
              options_.bucket_bytes, options_.first_bucket_bytes);
  // The last weight-producing action of each chunk: its gradients are complete for the step after it.
  const auto& actions = schedule.actions.at(rank);
  std::map<int, std::size_t> last_weight_action;
  for (std::size_t i = 0; i < actions.size(); ++i) {
    if (makes_weight_grads(actions[i].type)) last_weight_action[actions[i].stage] = i;
  }
  // Each tensor belongs to the chunk (among those listing it) whose last weight action comes latest.
  std::unordered_map<const c10::TensorImpl*, int> owner;
  for (const auto& [index, stage] : stages) {
    TWOBP_CHECK(last_weight_action.count(index) != 0, ScheduleError,
                "rank {}: stage {} has no B or W action in schedule '{}'", rank_, index, schedule.name);
    for (const auto& p : stage->parameters()) {
      auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), index);
      if (!inserted && last_weight_action[index] > last_weight_action[it->second]) it->second = index;
    }
  }
  // Buckets in the order the chunks finish their weight gradients; within a chunk its parameters in reverse
  // order (backward produces the last layers' gradients first), one dtype and device per bucket, closed at
  // bucket_bytes.
  std::vector<std::pair<std::size_t, int>> chunk_order;  // (last weight action, stage)
  for (const auto& [index, stage] : stages) chunk_order.emplace_back(last_weight_action[index], index);
  std::sort(chunk_order.begin(), chunk_order.end());
  double signature[3] = {0, 0, 0};  // tensors, elements, buckets: compared across replicas below
  for (const auto& [action, index] : chunk_order) {
    last_weight_action_[action] = index;
    std::map<std::pair<at::ScalarType, std::string>, std::size_t> open;  // (dtype, device) -> bucket
    const std::size_t first_of_stage = buckets_.size();  // the stage's first bucket (if any) gets this index
    const auto params = stages.at(index)->parameters();
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      const at::Tensor& param = *it;
      if (!param.requires_grad() || owner.at(param.unsafeGetTensorImpl()) != index) continue;
      const at::Tensor p = holder ? holder(param) : param;
      const auto key = std::make_pair(p.scalar_type(), p.device().str());
      auto found = open.find(key);
      const bool first = found != open.end() && found->second == first_of_stage;
      const std::int64_t cap = first ? std::min(options_.first_bucket_bytes, options_.bucket_bytes)
                                     : options_.bucket_bytes;
      if (found == open.end() ||
          buckets_[found->second].numel * static_cast<std::int64_t>(p.element_size()) >= cap) {
        buckets_.push_back(Bucket{index, {}, 0});
        found = open.insert_or_assign(key, buckets_.size() - 1).first;
      }
      Bucket& b = buckets_[found->second];
      slot_[param.unsafeGetTensorImpl()] = {found->second, b.params.size()};
      b.params.push_back(p);
      b.numel += p.numel();
      signature[0] += 1;
      signature[1] += static_cast<double>(p.numel());
    }
  }
  signature[2] = static_cast<double>(buckets_.size());
  // Replicas that disagree would reduce buffers of different sizes into each other: refuse before step 1.
  at::Tensor sums = at::tensor(std::vector<double>(signature, signature + 3), at::kDouble)
                        .to(options_.group->device());
  options_.group->all_reduce_sum(sums, timeout_);
  sums = sums.cpu();
  for (int k = 0; k < 3; ++k) {
    TWOBP_CHECK(sums[k].item<double>() == dp_ * signature[k], UsageError,
                "rank {} (replica {} of {}): the data-parallel replicas disagree on this rank's parameters (here "
                "{} tensors, {} elements, {} buckets; the replicas' mean {} {}): every replica must build the same "
                "chunks with the same parameters",
                rank_, options_.group->rank(), dp_, signature[0], signature[1], signature[2], sums[k].item<double>() / dp_,
                k == 0 ? "tensors" : k == 1 ? "elements" : "buckets");
  }
  reset();
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::begin_step() {
  buffers_.clear();
  for (const auto& [index, stage] : stages_) {
    for (const auto& item : stage->module().named_buffers()) {
      const at::Tensor& t = item.value();
      if (!t.defined()) continue;
      buffers_.push_back(Buffer{index, item.key(), t, t.is_inference() ? 0 : static_cast<std::int64_t>(t._version())});
    }
  }
}

void GradientReducer::check_buffers() const {
  // WHY refuse rather than average: a buffer updated in forward (BatchNorm's running statistics, a step counter)
  // has no gradient to reduce, and its update from one replica's share differs from one process's update on
  // the global batch; silently keeping per-replica values would make the replicas drift apart.
  for (const auto& b : buffers_) {
    const bool same = b.tensor.is_inference() || static_cast<std::int64_t>(b.tensor._version()) == b.version;
    const auto now = stages_.at(b.stage)->module().named_buffers().find(b.name);
    TWOBP_CHECK(same && now != nullptr && now->is_same(b.tensor), UsageError,
                "rank {} stage {}: buffer '{}' changed during the step; with data parallelism each replica would "
                "update it from its own share of the batch only (e.g. BatchNorm running statistics), unlike one "
                "process on the global batch. Use a module without running state (LayerNorm, RMSNorm), put it in "
                "eval() mode, or train without data parallelism",
                rank_, b.stage, b.name);
  }
}

autograd::ParametersDone GradientReducer::parameters_done(std::size_t index) {
  if (!options_.overlap) return nullptr;
  auto it = last_weight_action_.find(index);
  if (it == last_weight_action_.end()) return nullptr;
  const int stage = it->second;
  return [this, stage](const std::vector<at::Tensor>& params) { mark_final(stage, params); };
}

void GradientReducer::mark_final(int stage, const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    auto it = slot_.find(p.unsafeGetTensorImpl());
    if (it == slot_.end()) continue;  // not reduced here (frozen)
    const auto [bucket, k] = it->second;
    // A tensor shared with a later chunk of this rank is final only after that chunk's weight actions.
    if (buckets_[bucket].stage != stage || final_[bucket][k]) continue;
    final_[bucket][k] = true;
    --pending_[bucket];
  }
  start_ready();
}

void GradientReducer::mark_stage_final(int stage) {
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].stage != stage) continue;
    final_[b].assign(buckets_[b].params.size(), true);
    pending_[b] = 0;
  }
}

void GradientReducer::after_action(std::size_t index) {
  if (!options_.overlap) return;
  auto it = last_weight_action_.find(index);
  if (it == last_weight_action_.end()) return;
  mark_stage_final(it->second);
  start_ready();
}

void GradientReducer::start_ready() {
  while (next_ < buckets_.size() && pending_[next_] == 0) start(next_++);
}

void GradientReducer::start(std::size_t index) {
  Bucket& b = buckets_[index];
  c10::AutoGradMode no_grad(false);
  // [gradients..., one flag per parameter]: the flags count the replicas whose gradient is defined, so that
  // "undefined everywhere" stays undefined and "defined somewhere" becomes defined everywhere.
  std::vector<at::Tensor> pieces, flags;
  pieces.reserve(2 * b.params.size());
  flags.reserve(b.params.size());
  for (const auto& p : b.params) {
    const at::Tensor& g = p.grad();
    TWOBP_CHECK(!g.defined() || !g.is_sparse(), UsageError,
                "rank {} stage {}: a parameter {} has a sparse gradient; data-parallel reduction needs dense "
                "gradients (e.g. an embedding with sparse=false)",
                rank_, b.stage, describe_shape(p.sizes(), p.scalar_type()));
    pieces.push_back(g.defined() ? g.reshape({-1}).to(p.scalar_type())
                                 : at::zeros({p.numel()}, p.options().requires_grad(false)));
    // Written on the device (a fill each): a host vector copied over would synchronize with the compute stream.
    flags.push_back(at::full({1}, g.defined() ? 1.0 : 0.0, p.options().requires_grad(false)));
  }
  pieces.insert(pieces.end(), flags.begin(), flags.end());
  InFlight f;
  f.bucket = index;
  f.flat = at::cat(pieces);
  f.work = options_.group->all_reduce_sum_async(f.flat, timeout_);
  in_flight_.push_back(std::move(f));
}

void GradientReducer::write_back(InFlight& f, const double* defined) {
  Bucket& b = buckets_[f.bucket];
  c10::AutoGradMode no_grad(false);
  std::int64_t offset = 0;
  for (std::size_t k = 0; k < b.params.size(); ++k) {
    at::Tensor& p = b.params[k];
    const at::Tensor mean = f.flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
    if (defined[k] == 0.0) continue;  // undefined on every replica (so here too)
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined()) {
      grad.copy_(mean);
    } else {
      grad = mean.clone();
    }
  }
}

double GradientReducer::finish() {
  const Clock::time_point t0 = Clock::now();
  for (const auto& [action, stage] : last_weight_action_) mark_stage_final(stage);
  start_ready();
  std::vector<at::Tensor> flags;
  {
    c10::AutoGradMode no_grad(false);
    for (auto& f : in_flight_) {
      f.work->wait(timeout_);
      // The sum over replicas -> the mean (each replica's gradient is of its own mean loss); flags too.
      f.flat.div_(dp_);
      const Bucket& b = buckets_[f.bucket];
      flags.push_back(f.flat.narrow(0, b.numel, static_cast<std::int64_t>(b.params.size())).to(at::kDouble));
    }
  }
  if (!in_flight_.empty()) {
    // SYNC POINT (documented: one per step with data parallelism): which gradients are defined on any replica,
    // for every bucket in one copy.
    const at::Tensor defined = at::cat(flags).to(at::kCPU).contiguous();
    const double* d = defined.data_ptr<double>();
    for (auto& f : in_flight_) {
      write_back(f, d);
      d += buckets_[f.bucket].params.size();
    }
  }
  reset();
  check_buffers();
  return elapsed_us(t0);
}

void GradientReducer::reset() {
  in_flight_.clear();
  final_.clear();
  pending_.clear();
  for (const auto& b : buckets_) {
    final_.emplace_back(b.params.size(), false);
    pending_.push_back(b.params.size());
  }
  next_ = 0;
}

}  // namespace twobp::detail
