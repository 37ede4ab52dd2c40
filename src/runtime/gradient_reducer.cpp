#include "runtime/gradient_reducer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

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
  sharded_ = options.zero == ZeroStage::k2;
  if (sharded_) {
    // ZeRO-2 on a blocking transport (Local, Store) starts buckets inside the action stream too -- during its
    // stage's last W/B as the layers finish, the rest right after it -- so that the full gradients die during the
    // step there as well. WHY this cannot deadlock: buckets start in bucket order, and every bucket of a stage is
    // forced ready at the stage's last weight action, so every replica starts each bucket within (or right after)
    // the same action of the same action list, with no message in between; the collectives then sit at one
    // position of isomorphic dependency graphs, and merging matching nodes of isomorphic acyclic graphs leaves
    // them acyclic. (All-reduce keeps the old rule: its flags must cover data-dependent readiness the same way,
    // and the reduction is hidden anyway where it matters, on asynchronous transports.)
    const bool asynchronous = options_.group->asynchronous_sharded_collectives();
    options_.overlap = options.overlap;
    blocking_starts_ = options.overlap && !asynchronous;
  }
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
  // tensors, elements, buckets, ZeRO stage: compared across replicas below
  double signature[4] = {0, 0, 0, static_cast<double>(options_.zero == ZeroStage::k2 ? 2 : 0)};
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
        buckets_.push_back(Bucket{index, {}, 0, {}, {}, {}});
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
  at::Tensor sums = at::tensor(std::vector<double>(signature, signature + 4), at::kDouble)
                        .to(options_.group->device());
  options_.group->all_reduce_sum(sums, timeout_);
  sums = sums.cpu();
  for (int k = 0; k < 4; ++k) {
    TWOBP_CHECK(sums[k].item<double>() == dp_ * signature[k], UsageError,
                "rank {} (replica {} of {}): the data-parallel replicas disagree on this rank's parameters (here "
                "{} tensors, {} elements, {} buckets, ZeRO stage {}; the replicas' mean {} {}): every replica must "
                "build the same chunks with the same parameters and DataParallelOptions::zero",
                rank_, options_.group->rank(), dp_, signature[0], signature[1], signature[2], signature[3],
                sums[k].item<double>() / dp_,
                k == 0 ? "tensors" : k == 1 ? "elements" : k == 2 ? "buckets" : "ZeRO stage");
  }
  if (sharded_) lay_out_flat();
  reset();
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::lay_out_flat() {
  c10::AutoGradMode no_grad(false);
  const int replica = options_.group->rank();
  for (Bucket& b : buckets_) {
    b.flat = at::empty({b.numel}, b.params.front().options().requires_grad(false));
    std::int64_t offset = 0;
    for (at::Tensor& p : b.params) {
      at::Tensor view = b.flat.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p.detach());
      // The holder (parameter or master) keeps its identity -- modules, the fast path, MasterWeights and the
      // user's references see it -- and now lives in the flat buffer (Megatron's contiguous parameter buffer).
      p.set_data(view);
      offset += p.numel();
    }
    b.range = shard_range(b.numel, dp_, replica);
    // A plain tensor over the shard's storage (not an autograd view): the optimizer's parameter, stable for the
    // Pipeline's life, so that its state stays keyed to it.
    b.shard = at::empty({0}, b.flat.options());
    b.shard.set_(b.flat.storage(), b.flat.storage_offset() + b.range.begin, {b.range.size()}, {1});
    b.shard.set_requires_grad(true);
  }
}

std::vector<at::Tensor> GradientReducer::shards() const {
  std::vector<at::Tensor> out;
  for (const Bucket& b : buckets_) out.push_back(b.shard);
  return out;
}

void GradientReducer::zero_shard_grads() {
  for (Bucket& b : buckets_) {
    if (b.shard.defined()) b.shard.mutable_grad().reset();
  }
}

std::vector<GradientReducer::Slice> GradientReducer::layout() const {
  std::vector<Slice> out;
  for (std::size_t k = 0; k < buckets_.size(); ++k) {
    std::int64_t offset = 0;
    for (const at::Tensor& p : buckets_[k].params) {
      out.push_back(Slice{p, k, offset});
      offset += p.numel();
    }
  }
  return out;
}

void GradientReducer::gather_shards() {
  TWOBP_CHECK(sharded_, UsageError, "rank {}: gather_shards needs DataParallelOptions::zero = ZeroStage::k2", rank_);
  c10::AutoGradMode no_grad(false);
  // Started all, then waited: the transports overlap the buckets' all-gathers where they can.
  std::vector<std::pair<at::Tensor, std::unique_ptr<Work>>> works;
  for (Bucket& b : buckets_) {
    // WHY a copy: the shard is a part of the all-gather's own output buffer.
    at::Tensor mine = b.shard.detach().clone();
    works.emplace_back(mine, options_.group->all_gather_async(mine, b.flat, timeout_));
    bytes_sent_ += collective_bytes_sent(CollectiveKind::kAllGather, b.numel * b.flat.element_size(), dp_);
  }
  for (auto& [mine, work] : works) work->wait(timeout_);
}

void GradientReducer::sample_gradient_bytes(std::int64_t extra) {
  std::int64_t live = extra;
  std::unordered_set<const void*> seen;  // a shard's .grad is its reduce-scatter's output: counted once
  auto add = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (t.is_sparse()) {  // no storage of its own (refused at the reduction, but sampled before)
      live += t._values().nbytes() + t._indices().nbytes();
    } else if (seen.insert(t.storage().data()).second) {
      live += t.numel() * static_cast<std::int64_t>(t.element_size());
    }
  };
  for (const Bucket& b : buckets_) {
    for (const at::Tensor& p : b.params) add(p.grad());
    if (b.shard.defined()) add(b.shard.grad());
  }
  for (const InFlight& f : in_flight_) {
    add(f.flat);
    add(f.out);
  }
  gradient_peak_ = std::max(gradient_peak_, live);
}

void GradientReducer::begin_step() {
  bytes_sent_ = 0;
  gradient_peak_ = 0;
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
  if (track_peak_) sample_gradient_bytes(0);
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
  // "undefined everywhere" stays undefined and "defined somewhere" becomes defined everywhere. ZeRO-2 keeps its
  // flags apart (one all-reduce of all of them in finish()): a reduce-scatter would leave each replica a part.
  std::vector<at::Tensor> pieces, flags;
  pieces.reserve(2 * b.params.size());
  flags.reserve(b.params.size());
  InFlight f;
  f.bucket = index;
  for (const auto& p : b.params) {
    const at::Tensor& g = p.grad();
    TWOBP_CHECK(!g.defined() || !g.is_sparse(), UsageError,
                "rank {} stage {}: a parameter {} has a sparse gradient; data-parallel reduction needs dense "
                "gradients (e.g. an embedding with sparse=false)",
                rank_, b.stage, describe_shape(p.sizes(), p.scalar_type()));
    pieces.push_back(g.defined() ? g.reshape({-1}).to(p.scalar_type())
                                 : at::zeros({p.numel()}, p.options().requires_grad(false)));
    if (sharded_) {
      f.defined.push_back(g.defined() ? 1.0 : 0.0);
    } else {
      // Written on the device (a fill each): a host vector copied over would synchronize with the compute stream.
      flags.push_back(at::full({1}, g.defined() ? 1.0 : 0.0, p.options().requires_grad(false)));
    }
  }
  pieces.insert(pieces.end(), flags.begin(), flags.end());
  f.flat = at::cat(pieces);
  pieces.clear();
  const std::int64_t bytes = f.flat.numel() * f.flat.element_size();
  if (track_peak_) sample_gradient_bytes(bytes);  // the moment before the bucket's full gradients are released
  if (sharded_) {
    // ZeRO-2's memory: the full gradients die as soon as their bucket is in flight (its flat copy lives until the
    // reduce-scatter is done); this replica keeps only its shard of the sum.
    for (auto& p : b.params) p.mutable_grad().reset();
    f.out = at::empty({b.range.size()}, f.flat.options());
    f.work = options_.group->reduce_scatter_sum_async(f.flat, f.out, timeout_);
    bytes_sent_ += collective_bytes_sent(CollectiveKind::kReduceScatter, bytes, dp_);
  } else {
    f.work = options_.group->all_reduce_sum_async(f.flat, timeout_);
    bytes_sent_ += collective_bytes_sent(CollectiveKind::kAllReduce, bytes, dp_);
  }
  in_flight_.push_back(std::move(f));
  if (sharded_) {
    // A finished reduce-scatter's input copy is garbage: release it now (blocking transports finish inside
    // start(); asynchronous ones as the step goes), not at finish().
    for (InFlight& g : in_flight_) {
      if (g.flat.defined() && g.work->is_completed()) g.flat = at::Tensor();
    }
  }
}

void GradientReducer::finish_sharded() {
  c10::AutoGradMode no_grad(false);
  std::vector<double> local;
  for (auto& f : in_flight_) {
    f.work->wait(timeout_);
    f.out.div_(dp_);  // the sum over replicas -> the mean (each replica's gradient is of its own mean loss)
    f.flat = at::Tensor();
    local.insert(local.end(), f.defined.begin(), f.defined.end());
  }
  if (!local.empty()) {
    // SYNC POINT (one per step, as the flags of the all-reduce path): which parameters got a gradient anywhere.
    at::Tensor flags = at::tensor(local, at::kDouble).to(options_.group->device());
    options_.group->all_reduce_sum(flags, timeout_);
    bytes_sent_ += collective_bytes_sent(CollectiveKind::kAllReduce, flags.numel() * 8, dp_);
    flags = flags.cpu().contiguous();
    const double* d = flags.data_ptr<double>();
    for (const auto& f : in_flight_) {
      const Bucket& b = buckets_[f.bucket];
      for (const auto& p : b.params) {
        // WHY refuse: a flat shard is stepped whole; AdamW would decay a parameter that one process skips
        // (undefined gradient), so the result would differ silently from training without sharding.
        TWOBP_CHECK(*d++ != 0.0, UsageError,
                    "rank {} stage {}: parameter {} got no gradient on any replica this step; with "
                    "DataParallelOptions::zero = 2 the optimizer steps flat shards and would change it (weight "
                    "decay) where one process would skip it. Freeze it (requires_grad false before building the "
                    "Pipeline) or use zero 0 or 1",
                    rank_, b.stage, describe_shape(p.sizes(), p.scalar_type()));
      }
    }
  }
  for (auto& f : in_flight_) {
    at::Tensor& grad = buckets_[f.bucket].shard.mutable_grad();
    if (grad.defined()) {
      grad.add_(f.out);  // a step without zero_grad accumulates, as .grad does
    } else {
      grad = f.out;
    }
  }
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
  if (sharded_) {
    finish_sharded();
    if (track_peak_) sample_gradient_bytes(0);
    reset();
    check_buffers();
    return elapsed_us(t0);
  }
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
  if (track_peak_) sample_gradient_bytes(0);
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
