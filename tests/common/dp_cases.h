#pragma once
// Data x pipeline parity, written once for the thread test (Local transport) and the process test (MPI): dp
// replicas of a pp-rank pipeline train on one global batch; every rank's chunks must end with the gradients of
// one loss.backward() over the whole batch in a single process (float64), two steps without zero_grad.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/split_cases.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/pipeline.h"

namespace twobp::testing::dp {

constexpr int64_t kDim = 4;
constexpr int64_t kSeq = 3;
constexpr int64_t kMbs = 2;        // micro-batch size
constexpr int kMicroBatches = 4;   // per replica
constexpr int kSteps = 2;

inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return (out - target).pow(2).mean();
}

/// Parameters a replica uses or not depending on its data: `sometimes` only where the micro-batch's first input
/// element is positive (the data makes that replica 1's micro-batches only), `never` nowhere. One loss.backward()
/// over the global batch gives `sometimes` a gradient and leaves `never` undefined; so must the replicas.
struct DataDependent : CaseModule {
  DataDependent() {
    body = register_module("body", twobp::nn::Linear(kDim, kDim));
    sometimes = register_module("sometimes", twobp::nn::Linear(kDim, kDim));
    never = register_module("never", torch::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = torch::tanh(body(x)) + x;
    const double first = x.index({0, 0, 0}).item<double>();
    if (first > 0) h = h + sometimes(h);
    if (first > 100) h = h + never(h);
    return h;
  }
  twobp::nn::Linear body{nullptr}, sometimes{nullptr};
  torch::nn::Linear never{nullptr};
};

/// The chunk of stage s: DataDependent first, then the split classes whose gradients are the whole story (hooks,
/// unregistered leaves, per-chunk generators and sparse gradients have their own DP tests or notes).
inline std::shared_ptr<CaseModule> make_chunk(int s) {
  torch::manual_seed(100 + s);
  if (s == 0) return std::make_shared<DataDependent>();
  static const char* kClasses[] = {"RegisteredTwice", "Frozen", "SharedAcrossPaths", "ParameterOnlyInput",
                                   "InPlaceViews", "InPlaceViewWithParameter"};
  const std::string name = kClasses[(s - 1) % 6];
  for (const auto& c : supported_module_classes()) {
    if (c.name == name) return c.make(kDim);
  }
  throw std::logic_error("no split class " + name);
}

/// The global batch of dp * kMicroBatches micro-batches; replica r's are the r-th block of kMicroBatches.
struct GlobalBatch {
  torch::Tensor inputs, targets;
};

inline GlobalBatch global_batch(int dp) {
  torch::manual_seed(1);
  GlobalBatch b;
  b.inputs = torch::randn({dp * kMicroBatches * kMbs, kSeq, kDim});
  b.targets = torch::randn({dp * kMicroBatches * kMbs, kSeq, kDim});
  // DataDependent's switch: positive on the last replica's micro-batches only.
  for (int g = 0; g < dp * kMicroBatches; ++g) {
    b.inputs.index_put_({g * kMbs, 0, 0}, g / kMicroBatches == dp - 1 ? 0.5 : -0.5);
  }
  return b;
}

inline GlobalBatch replica_batch(const GlobalBatch& b, int replica) {
  const int64_t n = kMicroBatches * kMbs;
  return {b.inputs.narrow(0, replica * n, n), b.targets.narrow(0, replica * n, n)};
}

struct Reference {
  std::vector<std::shared_ptr<CaseModule>> chunks;  // by stage
  std::vector<std::vector<double>> losses;          // by step, by global micro-batch
};

/// One process, the whole batch: the mean loss over all dp * kMicroBatches micro-batches, backward, twice.
inline Reference reference(int stages, const GlobalBatch& b) {
  Reference ref;
  for (int s = 0; s < stages; ++s) ref.chunks.push_back(make_chunk(s));
  auto xs = b.inputs.split(kMbs), ys = b.targets.split(kMbs);
  const int n = static_cast<int>(xs.size());
  for (int step = 0; step < kSteps; ++step) {
    ref.losses.emplace_back();
    for (int g = 0; g < n; ++g) {
      torch::Tensor h = xs[g];
      for (auto& chunk : ref.chunks) h = chunk->forward(h);
      auto loss = mse(h, ys[g]);
      (loss / n).backward();
      ref.losses.back().push_back(loss.item<double>());
    }
  }
  return ref;
}

/// The schedule of one replica (pp ranks), or a reason it does not exist for this shape.
inline Schedule replica_schedule(const std::string& name, BackwardMode mode, int pp) {
  return make_schedule(name, default_schedule_options(name, pp, kMicroBatches, mode));
}

/// One rank of the job: builds its groups and pipeline over `world`, trains kSteps on its replica's share, and
/// returns its chunks (by stage) and, on a replica's last stage, the losses by step.
struct RankRun {
  std::map<int, std::shared_ptr<CaseModule>> chunks;
  std::vector<std::vector<double>> losses;
  int replica = 0;
};

inline void run_rank(Transport& world, int dp, const Schedule& schedule, bool overlap, const GlobalBatch& batch,
                     RankRun& out) {
  ParallelGroups groups(world, dp, std::chrono::seconds(60));
  out.replica = groups.replica();
  std::vector<PipelineChunk> chunks;
  for (int s : schedule.stages_of(groups.pipeline_rank())) {
    auto* raw = out.chunks.at(s).get();
    chunks.push_back({s, out.chunks.at(s), [raw](const at::Tensor& x) { return raw->forward(x); }});
  }
  PipelineOptions o;
  o.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.activation_spec = [](int) { return TensorSpec{{kMbs, kSeq, kDim}, at::kDouble}; };
  o.data_parallel.group = groups.data_parallel();
  o.data_parallel.overlap = overlap;
  o.data_parallel.bucket_bytes = 256;  // several buckets per chunk
  Pipeline pipeline(schedule, std::move(chunks), groups.pipeline(), o);
  const GlobalBatch mine = replica_batch(batch, groups.replica());
  for (int step = 0; step < kSteps; ++step) {
    StepResult result = pipeline.step(mine.inputs, mine.targets);
    if (!result.losses.empty()) out.losses.push_back(result.losses);
    if (dp > 1) EXPECT_GE(result.reduce_wait_us, 0.0);
  }
}

/// The chunks a pipeline rank owns, built exactly as the reference builds them.
inline std::map<int, std::shared_ptr<CaseModule>> chunks_of(const Schedule& schedule, int pipeline_rank) {
  std::map<int, std::shared_ptr<CaseModule>> chunks;
  for (int s : schedule.stages_of(pipeline_rank)) chunks[s] = make_chunk(s);
  return chunks;
}

/// Every chunk of the rank and its losses against the reference.
inline void expect_matches(const RankRun& run, const Reference& ref, const std::string& who) {
  for (const auto& [s, chunk] : run.chunks) {
    const std::string mismatch = compare_modules(*chunk, *ref.chunks[s], 1e-10);
    EXPECT_TRUE(mismatch.empty()) << who << " stage " << s << ": " << mismatch;
  }
  for (std::size_t step = 0; step < run.losses.size(); ++step) {
    ASSERT_EQ(run.losses[step].size(), static_cast<std::size_t>(kMicroBatches)) << who;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      EXPECT_NEAR(run.losses[step][mb], ref.losses[step][run.replica * kMicroBatches + mb], 1e-12)
          << who << " step " << step << " micro-batch " << mb;
    }
  }
}

}  // namespace twobp::testing::dp
