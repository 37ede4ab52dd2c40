#pragma once
// Data x pipeline parity, written once for the thread test (Local transport) and the process test (MPI): dp
// replicas of a pp-rank pipeline train on one global batch; every rank's chunks must end with the gradients of
// one loss.backward() over the whole batch in a single process (float64), two steps without zero_grad. With mixed
// precision (bfloat16 compute, float32 masters), the reference is the same bfloat16 computation in one process:
// each global micro-batch's bfloat16 gradient added to a float32 sum. After the steps every rank evaluates
// (Pipeline::evaluate) and must get the reference's forward loss over the global batch, gradients untouched.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/overlap_hook.h"
#include "common/split_cases.h"
#include "common/test_models.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"

namespace twobp::testing::dp {

constexpr int64_t kDim = 4;
constexpr int64_t kSeq = 3;
constexpr int64_t kMbs = 2;        // micro-batch size
constexpr int kMicroBatches = 4;   // per replica
constexpr int kSteps = 2;

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

/// kDefault: the chunks train in the default dtype (float64 in these tests). kMixedBf16:
/// PipelineOptions::mixed_precision with bfloat16 compute (chunks built in float32).
enum class Precision { kDefault, kMixedBf16 };

/// The chunk of stage s: DataDependent first, then the split classes whose gradients are the whole story (hooks,
/// unregistered leaves, per-chunk generators and sparse gradients have their own DP tests or notes). Mixed
/// precision leaves out SharedAcrossPaths (it refuses a fast-path parameter that ordinary ops use too: its
/// post-accumulate-grad hook would fire twice) and the classes with twobp::nn::RMSNorm (Frozen,
/// ParameterOnlyInput): the reference runs without a pipeline, where fast-path layers fall back to ATen, and the
/// fast RMSNorm's bfloat16 backward rounds differently (~1e-3 relative, measured), which would hide a reduction
/// error of that size. DataDependent keeps the undefined-vs-defined cases.
/// `frozen`: every parameter of the chunk frozen (a frozen encoder or embedding on the leading stages).
inline std::shared_ptr<CaseModule> make_chunk(int s, Precision precision = Precision::kDefault, bool frozen = false) {
  if (frozen) {
    auto chunk = make_chunk(s, precision);
    for (auto& p : chunk->parameters()) p.set_requires_grad(false);
    return chunk;
  }
  torch::manual_seed(100 + s);
  if (s == 0) return std::make_shared<DataDependent>();
  static const std::vector<std::string> kClasses = {"RegisteredTwice", "Frozen", "SharedAcrossPaths",
                                                    "ParameterOnlyInput", "InPlaceViews", "InPlaceViewWithParameter"};
  static const std::vector<std::string> kMixedClasses = {"RegisteredTwice", "InPlaceViews",
                                                         "InPlaceViewWithParameter"};
  const auto& classes = precision == Precision::kMixedBf16 ? kMixedClasses : kClasses;
  const std::string name = classes[(s - 1) % classes.size()];
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

using GradientsByName = std::map<std::string, at::Tensor>;  // parameter name -> float32 gradient (absent: none)

struct Reference {
  std::vector<std::shared_ptr<CaseModule>> chunks;  // by stage
  std::vector<std::vector<double>> losses;          // by step, by global micro-batch
  std::vector<GradientsByName> mixed_grads;         // kMixedBf16: by stage, the float32 sums
  double eval_loss = 0.0;  // after the steps: the mean forward loss over the global batch, without autograd
};

/// Called on every chunk before each step (the reference: before the step's first micro-batch), by the thread of
/// the rank that owns it: what a training loop does to its modules between steps.
using BeforeStep = std::function<void(int step, CaseModule& chunk)>;

/// One process, the whole batch: the mean loss over all dp * kMicroBatches micro-batches, backward, twice. With
/// kMixedBf16 the chunks and inputs are bfloat16 and every micro-batch's gradient is added to a float32 sum (what
/// the masters accumulate), the chunks' own .grad reset after each. The first `frozen_stages` chunks are frozen.
inline Reference reference(int stages, const GlobalBatch& b, Precision precision = Precision::kDefault,
                           const BeforeStep& before_step = nullptr, int frozen_stages = 0) {
  const bool mixed = precision == Precision::kMixedBf16;
  Reference ref;
  for (int s = 0; s < stages; ++s) {
    ref.chunks.push_back(make_chunk(s, precision, s < frozen_stages));
    if (mixed) ref.chunks.back()->to(at::kBFloat16);
  }
  if (mixed) ref.mixed_grads.resize(stages);
  auto xs = b.inputs.split(kMbs), ys = b.targets.split(kMbs);
  const int n = static_cast<int>(xs.size());
  for (int step = 0; step < kSteps; ++step) {
    ref.losses.emplace_back();
    if (before_step) {
      for (auto& chunk : ref.chunks) before_step(step, *chunk);
    }
    for (int g = 0; g < n; ++g) {
      torch::Tensor h = mixed ? xs[g].to(at::kBFloat16) : xs[g];
      for (auto& chunk : ref.chunks) h = chunk->forward(h);
      auto loss = mse(h, ys[g]);
      (loss / n).backward();
      ref.losses.back().push_back(loss.item<double>());
      if (!mixed) continue;
      for (int s = 0; s < stages; ++s) {
        // A tensor registered under two names (RegisteredTwice) is one parameter: every name gets its gradient.
        std::map<const c10::TensorImpl*, at::Tensor> taken;
        for (const auto& item : ref.chunks[s]->named_parameters()) {
          at::Tensor& grad = const_cast<at::Tensor&>(item.value()).mutable_grad();
          if (grad.defined()) taken[item.value().unsafeGetTensorImpl()] = grad.to(at::kFloat);
          grad.reset();
        }
        for (const auto& item : ref.chunks[s]->named_parameters()) {
          const auto g = taken.find(item.value().unsafeGetTensorImpl());
          if (g == taken.end()) continue;
          at::Tensor& sum = ref.mixed_grads[s][item.key()];
          sum = sum.defined() ? sum + g->second : g->second;
        }
      }
    }
  }
  torch::NoGradGuard no_grad;
  for (int g = 0; g < n; ++g) {
    torch::Tensor h = mixed ? xs[g].to(at::kBFloat16) : xs[g];
    for (auto& chunk : ref.chunks) h = chunk->forward(h);
    ref.eval_loss += mse(h, ys[g]).item<double>() / n;
  }
  return ref;
}

/// The schedule of one replica (pp ranks), or a reason it does not exist for this shape.
inline Schedule replica_schedule(const std::string& name, BackwardMode mode, int pp) {
  return make_schedule(name, default_schedule_options(name, pp, kMicroBatches, mode));
}

/// One rank of the job: builds its groups and pipeline over `world`, trains kSteps on its replica's share, and
/// returns its chunks (by stage) and, on a replica's last stage, the losses by step. With `then`, the steps after
/// the first run it (Pipeline::switch_schedule): the same sums, so the same reference.
struct RankRun {
  std::map<int, std::shared_ptr<CaseModule>> chunks;
  std::vector<std::vector<double>> losses;
  int replica = 0;
  std::map<int, GradientsByName> master_grads;  // kMixedBf16: by stage, the masters' gradients after the steps
  double eval_loss = -1.0;                      // Pipeline::evaluate on the replica's share, after the steps
};

inline void run_rank(Transport& world, int dp, const Schedule& schedule, bool overlap, const GlobalBatch& batch,
                     RankRun& out, Precision precision = Precision::kDefault, bool start_during_backward = true,
                     bool overlap_pairs = false, const Schedule* then = nullptr,
                     const BeforeStep& before_step = nullptr, int frozen_stages = 0) {
  const bool mixed = precision == Precision::kMixedBf16;
  ParallelGroups groups(world, dp, std::chrono::seconds(60));
  out.replica = groups.replica();
  std::vector<PipelineChunk> chunks;
  for (int s : schedule.stages_of(groups.pipeline_rank())) {
    auto* raw = out.chunks.at(s).get();
    chunks.push_back({s, out.chunks.at(s), [raw](const at::Tensor& x) { return raw->forward(x); }});
  }
  PipelineOptions o;
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = mse;
  const at::ScalarType dtype = mixed ? at::kBFloat16 : at::kDouble;
  // The outputs of frozen leading stages carry no gradient, and their specs say so.
  o.executor.activation_spec = [dtype, frozen_stages](int s) {
    return TensorSpec{{kMbs, kSeq, kDim}, dtype, "", /*requires_grad=*/s >= frozen_stages};
  };
  o.data_parallel.group = groups.data_parallel();
  o.data_parallel.overlap = overlap;
  o.data_parallel.start_during_backward = start_during_backward;
  std::atomic<int> overlap_calls{0};
  if (overlap_pairs) o.executor.overlap_forward_backward = concurrent_overlap(overlap_calls);
  o.data_parallel.bucket_bytes = 256;  // several buckets per chunk
  if (mixed) o.mixed_precision.compute_dtype = at::kBFloat16;
  Pipeline pipeline(schedule, std::move(chunks), groups.pipeline(), o);
  const GlobalBatch mine = replica_batch(batch, groups.replica());
  for (int step = 0; step < kSteps; ++step) {
    if (step == 1 && then != nullptr) pipeline.switch_schedule(*then);
    if (before_step) {
      for (auto& [s, chunk] : out.chunks) before_step(step, *chunk);
    }
    StepResult result = pipeline.step(mine.inputs, mine.targets);
    if (!result.losses.empty()) out.losses.push_back(result.losses);
    if (dp > 1) EXPECT_GE(result.reduce_wait_us, 0.0);
  }
  // Every rank of the schedules this is used with (dualpipev) has pairs; each ran through the hook once a step.
  if (overlap_pairs && then == nullptr) {
    int mine = 0;
    for (const Action& a : pipeline.schedule().actions[groups.pipeline_rank()]) mine += a.overlapped_with_next;
    EXPECT_GT(mine, 0);
    EXPECT_EQ(overlap_calls.load(), mine * kSteps);
  }
  // Evaluation between the last step and the (absent) optimizer: it must leave the gradients as they are (checked
  // by expect_matches afterwards) and give every rank the global batch's mean loss.
  out.eval_loss = pipeline.evaluate(mine.inputs, mine.targets);
  if (!mixed) return;
  for (const auto& [s, chunk] : out.chunks) {
    for (const auto& item : chunk->named_parameters()) {
      EXPECT_FALSE(item.value().grad().defined()) << "stage " << s << " " << item.key() << ": the compute "
                                                  << "parameter's gradient is moved to its master";
      const at::Tensor master = pipeline.master_weight(item.value());
      if (master.grad().defined()) out.master_grads[s][item.key()] = master.grad().clone();
    }
  }
}

/// The chunks a pipeline rank owns, built exactly as the reference builds them.
inline std::map<int, std::shared_ptr<CaseModule>> chunks_of(const Schedule& schedule, int pipeline_rank,
                                                             Precision precision = Precision::kDefault,
                                                             int frozen_stages = 0) {
  std::map<int, std::shared_ptr<CaseModule>> chunks;
  for (int s : schedule.stages_of(pipeline_rank)) chunks[s] = make_chunk(s, precision, s < frozen_stages);
  return chunks;
}

/// Every chunk of the rank and its losses against the reference. kDefault: every .grad and buffer (float64, to
/// 1e-10). kMixedBf16: every master's gradient defined exactly where the reference's is, and within 1e-5 of the
/// reference gradient's largest entry (float32 summation order is all that differs: the replicas sum their
/// micro-batches, then each other's sums, while the reference sums the global batch in order; the bfloat16
/// products are the same, since 1/m and 1/(dp m) scale them by powers of two); losses within 1e-6.
inline void expect_matches(const RankRun& run, const Reference& ref, const std::string& who,
                           Precision precision = Precision::kDefault) {
  const bool mixed = precision == Precision::kMixedBf16;
  for (const auto& [s, chunk] : run.chunks) {
    if (!mixed) {
      const std::string mismatch = compare_modules(*chunk, *ref.chunks[s], 1e-10);
      EXPECT_TRUE(mismatch.empty()) << who << " stage " << s << ": " << mismatch;
      continue;
    }
    const GradientsByName empty;
    const auto found = run.master_grads.find(s);
    const GradientsByName& got = found == run.master_grads.end() ? empty : found->second;
    for (const auto& item : chunk->named_parameters()) {
      SCOPED_TRACE(who + " stage " + std::to_string(s) + " " + item.key());
      const auto r = ref.mixed_grads[s].find(item.key());
      const auto g = got.find(item.key());
      ASSERT_EQ(g != got.end(), r != ref.mixed_grads[s].end()) << "defined vs undefined";
      if (r == ref.mixed_grads[s].end()) continue;
      ASSERT_EQ(g->second.scalar_type(), at::kFloat);
      const double scale = r->second.abs().max().item<double>();
      EXPECT_LE((g->second - r->second).abs().max().item<double>(), 1e-5 * scale);
    }
  }
  EXPECT_NEAR(run.eval_loss, ref.eval_loss, (mixed ? 1e-6 : 1e-12) * std::abs(ref.eval_loss))
      << who << ": Pipeline::evaluate against the reference's forward over the global batch";
  for (std::size_t step = 0; step < run.losses.size(); ++step) {
    ASSERT_EQ(run.losses[step].size(), static_cast<std::size_t>(kMicroBatches)) << who;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      const double want = ref.losses[step][run.replica * kMicroBatches + mb];
      EXPECT_NEAR(run.losses[step][mb], want, mixed ? 1e-6 * std::abs(want) : 1e-12)
          << who << " step " << step << " micro-batch " << mb;
    }
  }
}

}  // namespace twobp::testing::dp
