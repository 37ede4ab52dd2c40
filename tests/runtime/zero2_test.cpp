// ZeRO-2 (DataParallelOptions::zero = 2) with ranks as threads (Local transport): dp 2 x pp 2, every built-in
// schedule x {standard, 2BP}, AdamW with clipping; parameters and losses against one process on the global batch
// (float64, common/zero2_cases.h); ZeRO-1 and recomputation once each, mixed precision against ZeRO 0; the
// memory it releases, the traffic it sends, and what it refuses.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "common/expect_error.h"
#include "common/zero2_cases.h"
#include "twobp/error.h"
#include "twobp/checkpoint.h"
#include "twobp/models/llama.h"
#include "twobp/precision.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int kZeroDp = 2, kZeroPp = 2;

// The job on threads: each rank's outcome, by world rank.
std::vector<zero2::RankRun> run_zero_job(const zero2::Config& c) {
  const Schedule schedule = zero2::schedule_of(c, kZeroPp);
  const zero2::Batch batch = zero2::global_batch(kZeroDp);
  std::vector<zero2::RankRun> runs(kZeroDp * kZeroPp);
  for (int w = 0; w < kZeroDp * kZeroPp; ++w) runs[w].chunks = zero2::chunks_of(schedule, w % kZeroPp);
  auto world = make_local_transports(kZeroDp * kZeroPp);
  run_rank_threads(world, [&](Transport& t) { zero2::run_rank(t, kZeroDp, c, batch, runs[t.rank()]); })
      .rethrow_root_cause();
  return runs;
}

void expect_reference_parity(const zero2::Config& c) {
  Float64Default float64;
  Schedule schedule;
  try {
    schedule = zero2::schedule_of(c, kZeroPp);
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();
  }
  const zero2::Reference ref = zero2::reference(schedule.num_stages, zero2::global_batch(kZeroDp));
  const auto runs = run_zero_job(c);
  for (std::size_t w = 0; w < runs.size(); ++w) {
    const std::string who = "world rank " + std::to_string(w);
    zero2::expect_matches(runs[w], ref.params, ref.losses, 1e-10, who);
    for (std::size_t k = 0; k < ref.norms.size(); ++k) {
      EXPECT_NEAR(runs[w].norms[k], ref.norms[k], 1e-10 * ref.norms[k]) << who;
      EXPECT_GT(runs[w].norms[k], zero2::kMaxNorm) << who << ": clipping must act";
    }
    if (c.zero == ZeroStage::k2) {
      EXPECT_TRUE(runs[w].grads_released) << who << ": ZeRO-2 leaves no full gradient after the step";
      EXPECT_FALSE(runs[w].shard_sizes.empty()) << who;
    }
  }
}

struct ZeroCase {
  std::string schedule;
  BackwardMode mode;
};

class Zero2Parity : public ::testing::TestWithParam<ZeroCase> {};

TEST_P(Zero2Parity, MatchesOneProcessOnTheGlobalBatch) {
  zero2::Config c;
  c.schedule = GetParam().schedule;
  c.mode = GetParam().mode;
  expect_reference_parity(c);
}

std::vector<ZeroCase> zero_cases() {
  std::vector<ZeroCase> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) out.push_back({s, m});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, Zero2Parity, ::testing::ValuesIn(zero_cases()), [](const auto& info) {
  std::string n = info.param.schedule + "_" + (info.param.mode == BackwardMode::kSplit ? "2bp" : "standard");
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
});

TEST(Zero2, WithRecomputationMatchesOneProcess) {
  zero2::Config c;
  c.recompute = true;
  expect_reference_parity(c);
}

TEST(Zero2, ZeroOneUnchangedMatchesOneProcess) {
  zero2::Config c;
  c.zero = ZeroStage::k1;
  expect_reference_parity(c);
}

// A bucket of one element (`gain`) over two replicas: replica 1's shard of it is empty; sizes not divisible by dp.
TEST(Zero2, ShardsFollowShardRangeWithAnEmptyOne) {
  Float64Default float64;
  const auto runs = run_zero_job(zero2::Config{});
  for (int w = 0; w < kZeroDp * kZeroPp; ++w) {
    const auto& sizes = runs[w].shard_sizes;
    ASSERT_FALSE(sizes.empty());
    // The last bucket of the (one) stage is `gain` alone: shard_range(1, 2, r) is 1 element for replica 0, 0 for 1.
    EXPECT_EQ(sizes.back(), w / kZeroPp == 0 ? 1 : 0) << "world rank " << w;
    // The first, `down.bias` (5 elements): 3 and 2.
    EXPECT_EQ(sizes.front(), w / kZeroPp == 0 ? 3 : 2) << "world rank " << w;
  }
}

// Mixed precision: no float64 reference; ZeRO-2 against ZeRO 0 at the same dp, in float32 (the masters).
TEST(Zero2, MixedPrecisionMatchesZeroZero) {
  zero2::Config c;
  c.mixed = true;
  const auto sharded = run_zero_job(c);
  c.zero = ZeroStage::k0;
  const auto plain = run_zero_job(c);
  for (std::size_t w = 0; w < plain.size(); ++w) {
    EXPECT_EQ(sharded[w].params.begin()->second.scalar_type(), at::kFloat);
    // The norm's float32 sums run in another order (shards), so clipping scales differ in the last bits.
    zero2::expect_matches(sharded[w], plain[w].params, plain[w].losses, 1e-5, "world rank " + std::to_string(w));
  }
}

// A parameter that trains but gets no gradient on any replica: a flat shard would be stepped whole (weight decay
// where one process skips it), so the first step refuses it, naming the stage (every rank decides alike; a rank
// told by a peer's abort first carries the same message).
TEST(Zero2, RefusesAParameterWithoutAGradientAnywhere) {
  Float64Default float64;
  const zero2::Config c;
  const Schedule schedule = zero2::schedule_of(c, kZeroPp);
  const zero2::Batch batch = zero2::global_batch(kZeroDp);
  std::vector<std::map<int, std::shared_ptr<zero2::Net>>> chunks(kZeroDp * kZeroPp);
  for (int w = 0; w < kZeroDp * kZeroPp; ++w) {
    chunks[w] = zero2::chunks_of(schedule, w % kZeroPp);
    for (auto& [s, chunk] : chunks[w]) chunk->register_parameter("unused", torch::zeros({3}));
  }
  std::vector<std::string> errors(kZeroDp * kZeroPp);
  auto world = make_local_transports(kZeroDp * kZeroPp);
  run_rank_threads(world, [&](Transport& t) {
    zero2::RankRun run;
    run.chunks = chunks[t.rank()];
    try {
      zero2::run_rank(t, kZeroDp, c, batch, run);
    } catch (const std::exception& e) {
      errors[t.rank()] = e.what();
    }
  });
  for (int w = 0; w < kZeroDp * kZeroPp; ++w) {
    EXPECT_NE(errors[w].find("got no gradient on any replica"), std::string::npos) << "world rank " << w << ": "
                                                                                   << errors[w];
  }
}

// What each stage keeps and sends (float64 parameters, AdamW: 16 bytes of state per element at ZeRO 0).
TEST(Zero2, StateIsShardedAndTrafficIsNoMoreThanZeroOne) {
  Float64Default float64;
  zero2::Config c;
  const auto two = run_zero_job(c);
  c.zero = ZeroStage::k1;
  const auto one = run_zero_job(c);
  for (std::size_t w = 0; w < two.size(); ++w) {
    int64_t elements = 0;
    for (const auto& [name, p] : two[w].params) elements += p.numel();
    int64_t shard = 0;
    for (auto n : two[w].shard_sizes) shard += n;
    EXPECT_EQ(two[w].state_bytes, shard * 16) << "world rank " << w << ": AdamW's two moments of the shards only";
    EXPECT_LE(2 * shard, elements + static_cast<int64_t>(two[w].shard_sizes.size())) << "world rank " << w;
    EXPECT_GT(one[w].bytes_sent, 0);
    EXPECT_LT(two[w].bytes_sent, one[w].bytes_sent) << "world rank " << w;
  }
}

// The refusals: each names what to do instead.
TEST(Zero2, RefusesTiedParametersSwitchingAndAPlainOptimizer) {
  Float64Default float64;
  const zero2::Config c;
  const Schedule schedule = zero2::schedule_of(c, kZeroPp);
  const zero2::Batch batch = zero2::global_batch(kZeroDp);
  std::vector<std::map<int, std::shared_ptr<zero2::Net>>> chunks(kZeroDp * kZeroPp);
  for (int w = 0; w < kZeroDp * kZeroPp; ++w) chunks[w] = zero2::chunks_of(schedule, w % kZeroPp);
  auto world = make_local_transports(kZeroDp * kZeroPp);
  run_rank_threads(world, [&](Transport& t) {
    ParallelGroups groups(t, kZeroDp, std::chrono::seconds(60));
    auto build = [&](bool tied) {
      std::vector<PipelineChunk> pc;
      for (auto& [s, chunk] : chunks[t.rank()]) {
        zero2::Net* raw = chunk.get();
        pc.push_back({s, chunk, [raw](const at::Tensor& x) { return raw->forward(x); }});
      }
      PipelineOptions o;
      o.executor.timeout = std::chrono::seconds(60);
      o.loss = mse;
      o.data_parallel.group = groups.data_parallel();
      o.data_parallel.zero = ZeroStage::k2;
      if (tied) o.tied_parameters = {TiedParameter{"gain", {{0, "gain"}, {1, "gain"}}}};
      return std::make_unique<Pipeline>(schedule, std::move(pc), groups.pipeline(), o);
    };
    expect_error<UsageError>([&] { build(true); }, {"tied_parameters is not supported yet"});
    auto pipeline = build(false);
    expect_error<UsageError>([&] { pipeline->switch_schedule(schedule); }, {"switch_schedule with"});
    // A plain optimizer over parameters() would see no gradient: the next step refuses.
    const int64_t rows = zero2::kMicroBatches * zero2::kMbs;
    const bool first = groups.pipeline_rank() == 0, last = groups.pipeline_rank() == kZeroPp - 1;
    const NamedTensors in(batch.inputs.narrow(0, groups.replica() * rows, rows));
    const NamedTensors target(batch.targets.narrow(0, groups.replica() * rows, rows));
    pipeline->step(first ? in : NamedTensors(), last ? target : NamedTensors());
    ASSERT_TRUE(pipeline->ready_for_optimizer(0, NonFinitePolicy::kStop));
    expect_error<UsageError>(
        [&] { pipeline->step(first ? in : NamedTensors(), last ? target : NamedTensors()); },
        {"ShardedOptimizer(pipeline, factory)"});
  }).rethrow_root_cause();
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

namespace ck = twobp::checkpoint;

// A checkpoint by global name ("stage/parameter", and the AdamW state as checkpoint::adamw_state_tensors names it).
struct Snapshot {
  ck::NamedTensors params, state;
};

struct CheckpointRun {
  Snapshot restored;  // right after loading (`load`): what the optimizer and parameters hold
  Snapshot saved;     // after `save_at` steps
  Snapshot last;      // after every step
};

// One rank of a dp x pp job at `zero` over the global batch (each replica its share), optionally loading `load`
// first; snapshots gathered by global name (ZeRO-2: ShardedOptimizer::gathered_adamw_state, collective).
CheckpointRun run_checkpoint_rank(Transport& t, int dp, const Schedule& schedule, ZeroStage zero,
                                  const zero2::Batch& batch, std::map<int, std::shared_ptr<zero2::Net>>& chunks,
                                  int steps, int save_at, const Snapshot* load) {
  ParallelGroups groups(t, dp, std::chrono::seconds(60));
  std::vector<PipelineChunk> pc;
  for (auto& [s, chunk] : chunks) {
    zero2::Net* raw = chunk.get();
    pc.push_back({s, chunk, [raw](const at::Tensor& x) { return raw->forward(x); }});
  }
  PipelineOptions o;
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.data_parallel.group = groups.data_parallel();
  o.data_parallel.zero = zero;
  o.data_parallel.bucket_bytes = 64;
  Pipeline pipeline(schedule, std::move(pc), groups.pipeline(), o);
  ck::NamedTensors named;
  for (auto& [s, chunk] : chunks) {
    for (const auto& item : chunk->named_parameters()) {
      named.emplace_back(std::to_string(s) + "/" + item.key(), pipeline.master_weight(item.value()));
    }
  }
  auto make = [](std::vector<at::Tensor> ps) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::AdamW>(std::move(ps), zero2::adamw_options());
  };
  std::unique_ptr<torch::optim::AdamW> plain;
  std::unique_ptr<ShardedOptimizer> sharded;
  if (zero == ZeroStage::k0) {
    plain = std::make_unique<torch::optim::AdamW>(pipeline.parameters(), zero2::adamw_options());
  } else {
    sharded = std::make_unique<ShardedOptimizer>(pipeline, make);
  }
  auto snapshot = [&] {
    Snapshot s;
    for (const auto& [name, p] : named) s.params.emplace_back(name, p.detach().clone());
    // Copies: adamw_state_tensors gives the optimizer's live tensors, which later steps change.
    const ck::NamedTensors state =
        sharded ? sharded->gathered_adamw_state(named) : ck::adamw_state_tensors(*plain, named);
    for (const auto& [name, t] : state) s.state.emplace_back(name, t.clone());
    return s;
  };
  CheckpointRun out;
  if (load != nullptr) {
    ck::NamedTensors mine;  // this rank's parameters and their state, out of the whole checkpoint
    const auto wanted = ck::state_of(named);
    for (const auto& entries : {load->params, load->state}) {
      for (const auto& e : entries) {
        if (wanted(e.first)) mine.push_back(e);
      }
    }
    if (plain) {
      ck::restore(mine, named, plain.get());
    } else {
      torch::NoGradGuard no_grad;
      for (auto& [name, p] : named) {
        for (const auto& [n, v] : load->params) {
          if (n == name) p.copy_(v);
        }
      }
      sharded->restore_adamw_state(mine, named);
    }
    out.restored = snapshot();
  }
  const int64_t rows = batch.inputs.size(0) / dp;
  const bool first = schedule.stage_to_rank[0] == groups.pipeline_rank();
  const bool last = schedule.stage_to_rank[schedule.num_stages - 1] == groups.pipeline_rank();
  const NamedTensors in(batch.inputs.narrow(0, groups.replica() * rows, rows));
  const NamedTensors target(batch.targets.narrow(0, groups.replica() * rows, rows));
  for (int step = 0; step < steps; ++step) {
    pipeline.zero_grad();
    pipeline.step(first ? in : NamedTensors(), last ? target : NamedTensors());
    EXPECT_TRUE(pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop, zero2::kMaxNorm));
    if (plain) {
      plain->step();
    } else {
      sharded->step();
    }
    if (step + 1 == save_at) out.saved = snapshot();
  }
  out.last = snapshot();
  return out;
}

// Every rank's snapshot of replica 0 (world ranks 0 .. pp-1) merged: the whole model by global name.
Snapshot merged(const std::vector<CheckpointRun>& runs, int pp, Snapshot CheckpointRun::*which) {
  Snapshot all;
  for (int r = 0; r < pp; ++r) {
    const Snapshot& s = runs[r].*which;
    all.params.insert(all.params.end(), s.params.begin(), s.params.end());
    all.state.insert(all.state.end(), s.state.begin(), s.state.end());
  }
  return all;
}

// `got` equals `want` entry by entry (by name), within `rel` of each entry's largest value (0: bitwise).
void expect_same_snapshot(const Snapshot& got, const Snapshot& want, double rel, const std::string& what) {
  for (ck::NamedTensors Snapshot::*part : {&Snapshot::params, &Snapshot::state}) {
    std::map<std::string, at::Tensor> by_name((got.*part).begin(), (got.*part).end());
    ASSERT_EQ(by_name.size(), (want.*part).size()) << what;
    for (const auto& [name, w] : want.*part) {
      const auto g = by_name.find(name);
      ASSERT_NE(g, by_name.end()) << what << ": " << name;
      ASSERT_EQ(g->second.sizes(), w.sizes()) << what << ": " << name;
      if (rel == 0) {
        EXPECT_TRUE(at::equal(g->second, w))
            << what << ": " << name << " differs by up to " << (g->second - w).abs().max().item<double>();
      } else {
        const double scale = std::max(w.abs().max().item<double>(), 1e-300);
        EXPECT_LE((g->second - w).abs().max().item<double>(), rel * scale) << what << ": " << name;
      }
    }
  }
}

std::vector<CheckpointRun> run_checkpoint_job(int dp, const Schedule& schedule, ZeroStage zero, int steps,
                                              int save_at, const Snapshot* load) {
  const int pp = schedule.num_ranks;
  const zero2::Batch batch = zero2::global_batch(2);  // one global batch for every layout
  std::vector<std::map<int, std::shared_ptr<zero2::Net>>> chunks(dp * pp);
  for (int w = 0; w < dp * pp; ++w) chunks[w] = zero2::chunks_of(schedule, w % pp);
  std::vector<CheckpointRun> runs(dp * pp);
  auto world = make_local_transports(dp * pp);
  run_rank_threads(world, [&](Transport& t) {
    runs[t.rank()] = run_checkpoint_rank(t, dp, schedule, zero, batch, chunks[t.rank()], steps, save_at, load);
  }).rethrow_root_cause();
  return runs;
}

// Saved at (dp 2, zero 2, pp 2: 4 stages, 2 per rank), resumed at (dp 1, zero 0, pp 4), and back: the restore is
// exact (the optimizer then holds, gathered, exactly the saved state), and the resumed runs continue as the
// uninterrupted one (float64, within 1e-10: dp 1 and dp 2 sum the batch in another order).
TEST(Zero2, CheckpointResumesAcrossDataParallelZeroAndPipelineLayouts) {
  Float64Default float64;
  const Schedule dp2 = make_schedule("interleaved-1f1b",
                                     default_schedule_options("interleaved-1f1b", 2, 4, BackwardMode::kSplit));
  const Schedule dp1 = make_schedule("1f1b", default_schedule_options("1f1b", 4, 4, BackwardMode::kSplit));
  ASSERT_EQ(dp2.num_stages, 4);
  ASSERT_EQ(dp1.num_stages, 4);
  // The uninterrupted run: 5 steps, saved after 3 and 4.
  const auto a3 = run_checkpoint_job(2, dp2, ZeroStage::k2, 5, 3, nullptr);
  const auto a4 = run_checkpoint_job(2, dp2, ZeroStage::k2, 4, 4, nullptr);
  const Snapshot saved3 = merged(a3, 2, &CheckpointRun::saved);
  const Snapshot saved4 = merged(a4, 2, &CheckpointRun::saved);
  const Snapshot last5 = merged(a3, 2, &CheckpointRun::last);
  ASSERT_FALSE(saved3.state.empty());
  // Replica 1 gathers the same whole state.
  expect_same_snapshot(merged({a3[2], a3[3]}, 2, &CheckpointRun::saved), saved3, 0, "replica 1's gathered state");
  // To dp 1, zero 0, pp 4: exact restore, then one step = the 4th step.
  const auto b = run_checkpoint_job(1, dp1, ZeroStage::k0, 1, 1, &saved3);
  expect_same_snapshot(merged(b, 4, &CheckpointRun::restored), saved3, 0, "restored at dp 1 zero 0 pp 4");
  const Snapshot b4 = merged(b, 4, &CheckpointRun::last);
  expect_same_snapshot(b4, saved4, 1e-10, "resumed at dp 1 zero 0 pp 4, one step");
  // And back to dp 2, zero 2, pp 2 from that checkpoint: exact restore, then one step = the 5th.
  const auto d = run_checkpoint_job(2, dp2, ZeroStage::k2, 1, 1, &b4);
  expect_same_snapshot(merged(d, 2, &CheckpointRun::restored), b4, 0, "restored at dp 2 zero 2 pp 2");
  expect_same_snapshot(merged(d, 2, &CheckpointRun::last), last5, 1e-10, "resumed at dp 2 zero 2 pp 2, one step");
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

// The planner's ZeRO-2 (MemoryPlanOptions::gradient_shards): gradients kept between steps halve at dp 2. The peak is
// an upper bound: where W runs once per step (gpipe 2BP) the full gradient is counted during that W (beside its
// pending activations), so the peak does not rise; with W per micro-batch it is ZeRO-1's (the full gradient
// accumulates until the last W).
TEST(Zero2, MemoryPlanPredictsShardedGradients) {
  models::LlamaConfig config;
  config.name = "plan";
  config.dim = 64;
  config.n_layers = 4;
  config.n_heads = config.n_kv_heads = 4;
  config.ffn_dim = 172;
  config.vocab_size = 256;
  config.max_seq_len = 32;
  auto plan = [&](const std::string& name, int gradient_shards) {
    const Schedule s = make_schedule(name, default_schedule_options(name, 2, 4, BackwardMode::kSplit));
    models::MemoryPlanOptions o;
    o.micro_batch_size = 2;
    o.seq_len = 32;
    o.precision = models::training_precision(Precision::kFloat32);
    o.optimizer_shards = 2;
    o.gradient_shards = gradient_shards;
    return models::estimate_memory(config, models::make_partition(config, s.num_stages, 32), s, o);
  };
  const auto one = plan("gpipe", 1), two = plan("gpipe", 2);
  for (std::size_t r = 0; r < one.size(); ++r) {
    EXPECT_DOUBLE_EQ(two[r].gradients, one[r].gradients / 2);
    EXPECT_LE(two[r].total, one[r].total) << "rank " << r;
  }
  const auto per_mb_one = plan("zb-h1", 1), per_mb_two = plan("zb-h1", 2);
  for (std::size_t r = 0; r < per_mb_one.size(); ++r) EXPECT_DOUBLE_EQ(per_mb_two[r].total, per_mb_one[r].total);
}

}  // namespace
}  // namespace twobp::testing
