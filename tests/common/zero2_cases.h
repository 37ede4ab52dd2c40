#pragma once
// ZeRO-2 (DataParallelOptions::zero = ZeroStage::k2) parity, written once for the thread test (Local transport) and
// the process test (MPI): dp replicas of a pp-rank pipeline train kSteps AdamW steps on one global batch, with
// clipping through the optimizer gate (max_norm below the gradients' norm, so it acts); every rank's parameters
// and the losses must equal one process training on the whole batch (float64: loss.backward() over the global
// batch, the same clipping and AdamW), or, with mixed precision, the same job at ZeRO 0.
//
// The chunk's sizes are chosen so that the flat buckets do not divide by dp (5 x 7 weights, 7 and 5 biases) and so
// that one bucket -- the scalar `gain`, the module's own parameter, listed first and so last in the reverse-order
// buckets, after a bucket closed by the 35-element weight -- holds a single element: one replica's shard of it is
// empty.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/test_models.h"
#include "twobp/nn/modules.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/schedule/registry.h"

namespace twobp::testing::zero2 {

constexpr int64_t kDim = 5, kHidden = 7, kMbs = 2;
constexpr int kMicroBatches = 4, kSteps = 3;
constexpr double kMaxNorm = 0.05;  // below the gradients' norm (O(0.1 .. 1)): clipping acts every step

struct Net : torch::nn::Module {
  Net() {
    up = register_module("up", twobp::nn::Linear(kDim, kHidden));  // fast path (W deferred)
    down = register_module("down", torch::nn::Linear(kHidden, kDim));  // general path
    gain = register_parameter("gain", torch::full({1}, 0.7));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + gain * down(torch::tanh(up(x))); }
  twobp::nn::Linear up{nullptr};
  torch::nn::Linear down{nullptr};
  torch::Tensor gain;
};

inline std::shared_ptr<Net> make_stage(int s) {
  torch::manual_seed(300 + s);
  return std::make_shared<Net>();
}

struct Config {
  std::string schedule = "1f1b";
  BackwardMode mode = BackwardMode::kSplit;
  ZeroStage zero = ZeroStage::k2;
  bool mixed = false;
  bool recompute = false;
};

inline Schedule schedule_of(const Config& c, int pp) {
  return make_schedule(c.schedule, default_schedule_options(c.schedule, pp, kMicroBatches, c.mode));
}

/// The global batch: dp replicas' shares of kMicroBatches micro-batches each, in replica order.
struct Batch {
  torch::Tensor inputs, targets;
};
inline Batch global_batch(int dp) {
  torch::manual_seed(7);
  return {torch::randn({dp * kMicroBatches * kMbs, kDim}), torch::randn({dp * kMicroBatches * kMbs, kDim})};
}

inline torch::optim::AdamWOptions adamw_options() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

/// What one rank ends with.
struct RankRun {
  std::map<int, std::shared_ptr<Net>> chunks;  // built before the rank runs (manual_seed is process-wide)
  std::vector<double> losses;                  // Pipeline::mean_loss per step
  std::vector<double> norms;                   // the gate's norm (before clipping) per step
  std::map<std::string, torch::Tensor> params;  // "stage/name" -> value (masters under mixed precision)
  std::int64_t state_bytes = 0;
  std::int64_t bytes_sent = 0;        // data-parallel collectives of the last step (gradients + optimizer)
  std::vector<std::int64_t> shard_sizes;  // ZeRO-2: this replica's shards
  bool grads_released = true;         // ZeRO-2: every parameter's full .grad undefined after each step
};

inline std::map<int, std::shared_ptr<Net>> chunks_of(const Schedule& schedule, int pipeline_rank) {
  std::map<int, std::shared_ptr<Net>> out;
  for (int s : schedule.stages_of(pipeline_rank)) out[s] = make_stage(s);
  return out;
}

/// One rank: groups over `world`, a pipeline at c.zero, kSteps steps of AdamW on its replica's share.
inline void run_rank(Transport& world, int dp, const Config& c, const Batch& batch, RankRun& out) {
  const Duration timeout = std::chrono::seconds(60);
  ParallelGroups groups(world, dp, timeout);
  const int pp = world.world_size() / dp;
  const Schedule schedule = schedule_of(c, pp);
  std::vector<PipelineChunk> chunks;
  for (auto& [s, chunk] : out.chunks) {
    Net* raw = chunk.get();
    chunks.push_back({s, chunk, [raw](const at::Tensor& x) { return raw->forward(x); }, c.recompute});
  }
  PipelineOptions o;
  o.executor.timeout = timeout;
  o.loss = mse;
  o.data_parallel.group = groups.data_parallel();
  o.data_parallel.zero = c.zero;
  o.data_parallel.bucket_bytes = 64;       // several buckets per chunk
  o.data_parallel.first_bucket_bytes = 1;  // the first (`down.bias`) alone
  if (c.mixed) o.mixed_precision.compute_dtype = at::kBFloat16;
  Pipeline pipeline(schedule, std::move(chunks), groups.pipeline(), o);
  auto make = [](std::vector<at::Tensor> ps) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::AdamW>(std::move(ps), adamw_options());
  };
  std::unique_ptr<torch::optim::AdamW> plain;
  std::unique_ptr<ShardedOptimizer> sharded;
  if (c.zero == ZeroStage::k0) {
    plain = std::make_unique<torch::optim::AdamW>(pipeline.parameters(), adamw_options());
  } else {
    sharded = std::make_unique<ShardedOptimizer>(pipeline, make);
  }
  for (const auto& shard : pipeline.parameter_shards()) out.shard_sizes.push_back(shard.numel());
  const int64_t rows = kMicroBatches * kMbs;
  const NamedTensors in(batch.inputs.narrow(0, groups.replica() * rows, rows));
  const NamedTensors target(batch.targets.narrow(0, groups.replica() * rows, rows));
  const bool first = schedule.stage_to_rank[0] == groups.pipeline_rank();
  const bool last = schedule.stage_to_rank[schedule.num_stages - 1] == groups.pipeline_rank();
  for (int step = 0; step < kSteps; ++step) {
    pipeline.zero_grad();
    const StepResult r = pipeline.step(first ? in : NamedTensors(), last ? target : NamedTensors());
    out.losses.push_back(pipeline.mean_loss(r));
    if (c.zero == ZeroStage::k2) {
      for (const auto& p : pipeline.parameters()) out.grads_released = out.grads_released && !p.grad().defined();
    }
    EXPECT_TRUE(pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop, kMaxNorm));
    out.norms.push_back(pipeline.last_gradient_check().norm);
    if (plain) {
      plain->step();
    } else {
      sharded->step();
    }
    out.bytes_sent = pipeline.data_parallel_bytes_sent() + (sharded ? sharded->bytes_sent() : 0);
  }
  for (const auto& [s, chunk] : out.chunks) {
    for (const auto& item : chunk->named_parameters()) {
      out.params[std::to_string(s) + "/" + item.key()] = pipeline.master_weight(item.value()).detach().clone();
    }
  }
  out.state_bytes = sharded ? sharded->state_bytes() : 0;
}

/// One process on the whole batch: every stage in order, loss.backward(), clipping as the gate clips, AdamW.
struct Reference {
  std::vector<double> losses, norms;
  std::map<std::string, torch::Tensor> params;
};

inline Reference reference(int num_stages, const Batch& batch) {
  std::vector<std::shared_ptr<Net>> stages;
  std::vector<torch::Tensor> params;
  for (int s = 0; s < num_stages; ++s) {
    stages.push_back(make_stage(s));
    for (const auto& p : stages.back()->parameters()) params.push_back(p);
  }
  torch::optim::AdamW optimizer(params, adamw_options());
  Reference ref;
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    torch::Tensor h = batch.inputs;
    for (auto& st : stages) h = st->forward(h);
    const torch::Tensor loss = mse(h, batch.targets);  // = the mean of the equal micro-batches' means
    loss.backward();
    double sq = 0;
    for (const auto& p : params) sq += p.grad().pow(2).sum().item<double>();
    const double norm = std::sqrt(sq);
    if (norm > kMaxNorm) {
      torch::NoGradGuard no_grad;
      for (auto& p : params) p.mutable_grad().mul_(kMaxNorm / (norm + 1e-6));
    }
    optimizer.step();
    ref.losses.push_back(loss.item<double>());
    ref.norms.push_back(norm);
  }
  for (int s = 0; s < num_stages; ++s) {
    for (const auto& item : stages[s]->named_parameters()) {
      ref.params[std::to_string(s) + "/" + item.key()] = item.value().detach().clone();
    }
  }
  return ref;
}

/// `run`'s parameters and losses against `ref` within `rel` (relative to each tensor's largest entry).
inline void expect_matches(const RankRun& run, const std::map<std::string, torch::Tensor>& ref_params,
                           const std::vector<double>& ref_losses, double rel, const std::string& who) {
  ASSERT_FALSE(run.params.empty()) << who;
  for (const auto& [name, value] : run.params) {
    const auto found = ref_params.find(name);
    ASSERT_NE(found, ref_params.end()) << who << " " << name;
    const double scale = std::max(found->second.abs().max().item<double>(), 1e-300);
    const double diff = (value.to(at::kDouble) - found->second.to(at::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, rel * scale) << who << " " << name;
  }
  ASSERT_EQ(run.losses.size(), ref_losses.size()) << who;
  for (std::size_t k = 0; k < ref_losses.size(); ++k) {
    EXPECT_NEAR(run.losses[k], ref_losses[k], rel * std::abs(ref_losses[k])) << who << " step " << k;
  }
}

}  // namespace twobp::testing::zero2
