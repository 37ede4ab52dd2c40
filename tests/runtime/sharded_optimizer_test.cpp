// ShardedOptimizer (ZeRO-1): dp 2 x pp 2 on rank threads, against the same job with a plain AdamW per rank --
// three optimizer steps with clipping through the optimizer gate, float32 and mixed precision. The parameters must
// be the same (AdamW's update is elementwise, so the owner computes exactly what every replica would), the state
// split between the replicas, and the checkpoint view of the state (gathered, then restored into another sharded
// optimizer) equal to the plain optimizer's.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/test_models.h"
#include "twobp/checkpoint.h"
#include "twobp/error.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

namespace ck = twobp::checkpoint;

constexpr int kDp = 2, kPp = 2, kMicroBatches = 4, kSteps = 3;
constexpr int64_t kDim = 8, kRows = 2;
const Duration kTimeout = std::chrono::seconds(60);

// Stage 0 a fast-path MLP, stage 1 a LibTorch one (different sizes, so the greedy split is not trivial).
std::shared_ptr<torch::nn::Module> make_sharded_stage(int s) {
  torch::manual_seed(70 + s);
  if (s == 0) return FastMlp(kDim, 3 * kDim).ptr();
  return TorchMlp(kDim).ptr();
}

torch::Tensor run_stage(torch::nn::Module& m, int s, const torch::Tensor& x) {
  if (s == 0) return static_cast<FastMlpImpl&>(m).forward(x);
  return static_cast<TorchMlpImpl&>(m).forward(x);
}

struct RankOutcome {
  ck::NamedTensors params;         // (name, value) after the steps
  ck::NamedTensors adamw_state;    // the whole state, as a checkpoint holds it
  int64_t state_bytes = 0;         // this rank's optimizer state
  std::vector<double> next_losses;  // last stage: the step after a restore (restore test only)
  bool loaded_state_kept = true;    // the restore test: the steps after it left the restored-from tensors alone
};

enum class Optim { kPlain, kSharded };

// One dp x pp job of kSteps steps; `check_restore` then saves the gathered state, restores it into a fresh
// sharded optimizer over the same pipeline and runs two more steps.
std::vector<RankOutcome> run_job(Optim optim, bool mixed, bool check_restore = false) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{kPp, kMicroBatches, 1, BackwardMode::kSplit});
  torch::manual_seed(1);
  const auto inputs = torch::randn({kDp * kMicroBatches * kRows, kDim});
  const auto targets = torch::randn({kDp * kMicroBatches * kRows, kDim});
  std::vector<std::shared_ptr<torch::nn::Module>> modules(kDp * kPp);
  for (int w = 0; w < kDp * kPp; ++w) modules[w] = make_sharded_stage(w % kPp);  // built on this thread
  std::vector<RankOutcome> out(kDp * kPp);
  auto world = make_local_transports(kDp * kPp);
  run_rank_threads(world, [&](Transport& t) {
    const int w = t.rank();
    ParallelGroups groups(t, kDp, kTimeout);
    const int s = groups.pipeline_rank();
    auto* raw = modules[w].get();
    PipelineOptions o;
    o.executor.timeout = kTimeout;
    o.loss = mse;
    o.data_parallel.group = groups.data_parallel();
    o.data_parallel.bucket_bytes = 256;
    if (mixed) o.mixed_precision.compute_dtype = at::kBFloat16;
    Pipeline pipeline(schedule, {{s, modules[w], [raw, s](const at::Tensor& x) { return run_stage(*raw, s, x); }}},
                      groups.pipeline(), o);
    ck::NamedTensors named;
    for (const auto& item : modules[w]->named_parameters()) {
      named.emplace_back(item.key(), pipeline.master_weight(item.value()));
    }
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    auto make = [&](std::vector<at::Tensor> owned) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::AdamW>(std::move(owned), options);
    };
    std::unique_ptr<torch::optim::AdamW> plain;
    std::unique_ptr<ShardedOptimizer> sharded;
    if (optim == Optim::kPlain) {
      plain = std::make_unique<torch::optim::AdamW>(pipeline.parameters(), options);
    } else {
      sharded = std::make_unique<ShardedOptimizer>(pipeline.parameters(), groups.data_parallel(), make, kTimeout);
    }
    const int64_t share = static_cast<int64_t>(groups.replica()) * kMicroBatches * kRows;
    const auto mine_in = inputs.narrow(0, share, kMicroBatches * kRows);
    const auto mine_out = targets.narrow(0, share, kMicroBatches * kRows);
    auto train_step = [&](int step, ShardedOptimizer* with) {
      pipeline.zero_grad();
      StepResult r = pipeline.step(s == 0 ? NamedTensors(mine_in) : NamedTensors(),
                                   s == kPp - 1 ? NamedTensors(mine_out) : NamedTensors());
      // Clipping to a norm below the gradients' (they are O(1) here), so it acts.
      if (pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop, /*max_norm=*/0.05)) {
        if (with != nullptr) {
          with->step();
        } else {
          plain->step();
        }
      }
      return r;
    };
    for (int step = 0; step < kSteps; ++step) train_step(step, sharded.get());
    RankOutcome& me = out[w];
    for (const auto& [name, p] : named) me.params.emplace_back(name, p.detach().clone());
    me.adamw_state = sharded ? sharded->gathered_adamw_state(named) : ck::adamw_state_tensors(*plain, named);
    me.state_bytes = sharded ? sharded->state_bytes() : 0;
    if (plain) {
      for (const auto& [name, t] : ck::adamw_state_tensors(*plain, named)) {
        if (name.size() < 5 || name.substr(name.size() - 5) != ".step") me.state_bytes += t.numel() * t.element_size();
      }
    }
    if (check_restore && plain) {
      train_step(kSteps, nullptr);
      me.next_losses = train_step(kSteps + 1, nullptr).losses;  // sees the 4th update
    } else if (check_restore) {
      // A fresh sharded optimizer restored from the gathered state continues as the plain run does.
      ShardedOptimizer restored(pipeline.parameters(), groups.data_parallel(), make, kTimeout);
      ck::NamedTensors before;
      for (const auto& [name, t] : me.adamw_state) before.emplace_back(name, t.clone());
      restored.restore_adamw_state(me.adamw_state, named);
      train_step(kSteps, &restored);
      me.next_losses = train_step(kSteps + 1, &restored).losses;  // sees the restored step's update
      // The restore copied the state: the steps changed the optimizer's, not the caller's loaded tensors.
      for (std::size_t k = 0; k < before.size(); ++k) {
        me.loaded_state_kept = me.loaded_state_kept && at::equal(before[k].second, me.adamw_state[k].second);
      }
    }
  }).rethrow_root_cause();
  return out;
}

void expect_same(const ck::NamedTensors& a, const ck::NamedTensors& b, double rel, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].first, b[k].first) << what;
    const double scale = std::max(1e-30, b[k].second.abs().max().item<double>());
    EXPECT_LE((a[k].second.to(at::kDouble) - b[k].second.to(at::kDouble)).abs().max().item<double>(), rel * scale)
        << what << " " << a[k].first;
  }
}

class Sharding : public ::testing::TestWithParam<bool> {};

TEST_P(Sharding, SameParametersAndStateAsUnshardedDataParallel) {
  const bool mixed = GetParam();
  const auto plain = run_job(Optim::kPlain, mixed);
  const auto sharded = run_job(Optim::kSharded, mixed);
  for (int w = 0; w < kDp * kPp; ++w) {
    const std::string who = "world rank " + std::to_string(w);
    expect_same(sharded[w].params, plain[w].params, 1e-6, who + " parameter");
    expect_same(sharded[w].adamw_state, plain[w].adamw_state, 1e-6, who + " gathered state");
    // The replicas hold every stage's parameters alike, and the steps moved them.
    expect_same(sharded[w].params, sharded[w % kPp].params, 0.0, who + " vs replica 0");
  }
  // The state is split: the replicas of a stage hold, together, what one plain optimizer holds, each less.
  for (int s = 0; s < kPp; ++s) {
    const int64_t whole = plain[s].state_bytes;
    ASSERT_GT(whole, 0);
    int64_t sum = 0;
    for (int r = 0; r < kDp; ++r) {
      const int64_t mine = sharded[r * kPp + s].state_bytes;
      EXPECT_GT(mine, 0) << "stage " << s << " replica " << r;
      EXPECT_LE(mine, whole * 3 / 4) << "stage " << s << " replica " << r;
      sum += mine;
    }
    EXPECT_EQ(sum, whole) << "stage " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Precision, Sharding, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("mixed_bf16") : std::string("fp32"); });

// The gathered state restored into a fresh sharded optimizer: its first step updates the weights as the plain
// optimizer's 4th step does, which the losses of the step after it show (both replicas' last stage).
TEST(Sharding, GatheredStateRestoresIntoAnotherShardedOptimizer) {
  const auto sharded = run_job(Optim::kSharded, /*mixed=*/false, /*check_restore=*/true);
  const auto plain = run_job(Optim::kPlain, /*mixed=*/false, /*check_restore=*/true);
  for (int r = 0; r < kDp; ++r) {
    const int last = r * kPp + kPp - 1;
    ASSERT_EQ(sharded[last].next_losses.size(), static_cast<std::size_t>(kMicroBatches));
    ASSERT_EQ(plain[last].next_losses.size(), static_cast<std::size_t>(kMicroBatches));
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      EXPECT_NEAR(sharded[last].next_losses[mb], plain[last].next_losses[mb], 1e-6 * plain[last].next_losses[mb])
          << "replica " << r << " micro-batch " << mb;
    }
  }
  for (int w = 0; w < kDp * kPp; ++w) {
    EXPECT_TRUE(sharded[w].loaded_state_kept) << "world rank " << w << ": restore_adamw_state kept the caller's "
                                              << "tensors, and the steps after it changed them";
  }
}

TEST(Sharding, OwnershipIsGreedyBySizeAndSkipsFrozen) {
  auto a = torch::zeros({100}).requires_grad_(), b = torch::zeros({60}).requires_grad_(),
       c = torch::zeros({50}).requires_grad_(), frozen = torch::zeros({500});
  auto groups = make_local_transports(2);
  std::vector<std::vector<int>> owners(2);
  run_rank_threads(groups, [&](Transport& t) {
    ShardedOptimizer o({a, b, c, frozen}, &t,
                       [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
                         return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.1));
                       },
                       kTimeout);
    for (const auto& p : {a, b, c, frozen}) owners[t.rank()].push_back(o.owner_of(p));
    EXPECT_THROW(o.owner_of(torch::zeros({1})), UsageError);
  }).rethrow_root_cause();
  // 100 -> replica 0; 60 -> replica 1; 50 -> replica 1 (60 < 100); the frozen tensor -> nobody.
  const std::vector<int> expected = {0, 1, 1, -1};
  EXPECT_EQ(owners[0], expected);
  EXPECT_EQ(owners[1], expected);
}

// Ownership is fixed at construction: a parameter that starts requiring grad later has no owner and would never
// be stepped. step() refuses it before stepping anything; freezing one later is fine (its owner skips it).
TEST(Sharding, RefusesAParameterUnfrozenAfterConstruction) {
  auto a = torch::ones({3}).requires_grad_(), b = torch::ones({2}).requires_grad_(), late = torch::ones({4});
  a.mutable_grad() = torch::ones({3});
  ShardedOptimizer o({a, b, late}, nullptr,
                     [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
                       return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.5));
                     },
                     kTimeout);
  b.set_requires_grad(false);
  o.step();
  EXPECT_TRUE(torch::equal(a, torch::full({3}, 0.5))) << "stepped";
  late.set_requires_grad(true);
  late.mutable_grad() = torch::ones({4});
  expect_error<UsageError>([&] { o.step(); }, {"replica 0", "parameter 2 (shape [4]) requires grad", "new one"});
  EXPECT_TRUE(torch::equal(a, torch::full({3}, 0.5))) << "refused before stepping anything";
}

// set_lr: the learning rate of the next step, on the replicas that own parameters (a replica that owns none has
// no local optimizer and nothing to set).
TEST(Sharding, SetLrChangesTheNextStep) {
  auto a = torch::ones({3}).requires_grad_(), b = torch::ones({2}).requires_grad_();
  ShardedOptimizer o({a, b}, nullptr,
                     [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
                       return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.5));
                     },
                     kTimeout);
  o.set_lr(0.25);
  for (auto* p : {&a, &b}) p->mutable_grad() = torch::ones_like(*p);
  o.step();
  EXPECT_TRUE(torch::allclose(a, torch::full({3}, 0.75)));
  EXPECT_TRUE(torch::allclose(b, torch::full({2}, 0.75)));
  EXPECT_DOUBLE_EQ(o.local()->param_groups().front().options().get_lr(), 0.25);
}

}  // namespace
}  // namespace twobp::testing
