// The module classes of tests/common/split_cases.h through the pipeline (ranks as threads, Local transport) on
// every built-in schedule, standard and 2BP, float64, two steps without zero_grad: every stage's .grad (defined vs
// undefined, values), buffers and extras equal a single-process loss.backward() reference. Also: gradient norms
// and clipping count a tensor once however many names it has.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <exception>

#include "common/expect_error.h"
#include "common/split_cases.h"
#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/random.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int64_t kDim = 4;
constexpr int64_t kSeq = 3;
constexpr int64_t kMbs = 2;  // micro-batch size
constexpr int kRanks = 2;
constexpr int kMicroBatches = 4;
constexpr int kSteps = 2;

using ChunkFactory = std::function<std::shared_ptr<CaseModule>(int stage)>;
/// Called on every chunk before each step, by the thread of the rank that owns it (the reference: before the step's
/// first micro-batch): what a training loop does to its modules between steps.
using BeforeStep = std::function<void(int step, CaseModule& chunk)>;

// Chunks are built in stage order from per-stage seeds, on the calling thread, for the pipeline and the reference
// alike.
std::shared_ptr<CaseModule> build(const ChunkFactory& make, int s) {
  torch::manual_seed(100 + s);
  return make(s);
}

struct PipelineRun {
  std::vector<std::shared_ptr<CaseModule>> chunks;  // by stage
  std::vector<std::vector<double>> losses;          // by step, on the last stage's rank
  std::vector<std::exception_ptr> errors;           // by rank
  std::vector<double> norms;                        // by rank, from check_gradients after the last step
};

PipelineRun run_pipeline(const Schedule& schedule, const ChunkFactory& make, const torch::Tensor& inputs,
                         const torch::Tensor& targets, PipelineOptions options,
                         std::function<void(Pipeline&)> after_steps = nullptr,
                         std::function<bool(int stage)> recompute = nullptr,
                         const BeforeStep& before_step = nullptr) {
  PipelineRun run;
  run.chunks.resize(schedule.num_stages);
  for (int s = 0; s < schedule.num_stages; ++s) run.chunks[s] = build(make, s);
  auto transports = make_local_transports(schedule.num_ranks);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  for (int r = 0; r < schedule.num_ranks; ++r) {
    std::vector<PipelineChunk> chunks;
    for (int s : schedule.stages_of(r)) {
      auto* raw = run.chunks[s].get();
      chunks.push_back({s, run.chunks[s], [raw](const at::Tensor& x) { return raw->forward(x); },
                        recompute && recompute(s)});
    }
    pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks),
                                                   std::shared_ptr<Transport>(std::move(transports[r])), options));
  }
  run.norms.resize(schedule.num_ranks);
  run.losses.resize(kSteps);
  const int last_rank = schedule.stage_to_rank.back();
  std::vector<Transport*> transports_of;
  for (auto& p : pipelines) transports_of.push_back(&p->transport());
  run.errors = run_rank_threads(
                   transports_of,
                   [&](Transport& t) {
                     const int r = t.rank();
                     for (int step = 0; step < kSteps; ++step) {
                       if (before_step) {
                         for (int s : schedule.stages_of(r)) before_step(step, *run.chunks[s]);
                       }
                       auto result = pipelines[r]->step(inputs, targets);
                       if (r == last_rank) run.losses[step] = result.losses;
                     }
                     if (after_steps) after_steps(*pipelines[r]);
                   },
                   /*abort_on_error=*/false)
                   .errors;
  return run;
}

struct Reference {
  std::vector<std::shared_ptr<CaseModule>> chunks;
  std::vector<std::vector<double>> losses;
};

Reference run_reference(int stages, const ChunkFactory& make, const torch::Tensor& inputs,
                        const torch::Tensor& targets, const BeforeStep& before_step = nullptr) {
  Reference ref;
  for (int s = 0; s < stages; ++s) ref.chunks.push_back(build(make, s));
  auto xs = inputs.split(kMbs), ys = targets.split(kMbs);
  for (int step = 0; step < kSteps; ++step) {
    ref.losses.emplace_back();
    if (before_step) {
      for (auto& chunk : ref.chunks) before_step(step, *chunk);
    }
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      torch::Tensor h = xs[mb];
      for (int s = 0; s < stages; ++s) {
        StageRandomScope random(/*seed=*/0, s, mb, /*pass=*/step);  // the stage's own random stream, as in F
        h = ref.chunks[s]->forward(h);
      }
      auto loss = mse(h, ys[mb]);
      (loss / kMicroBatches).backward();
      ref.losses.back().push_back(loss.item<double>());
    }
  }
  return ref;
}

Schedule schedule_for(const std::string& name, BackwardMode mode) {
  return make_schedule(name, default_schedule_options(name, kRanks, kMicroBatches, mode));
}

PipelineOptions options() {
  PipelineOptions o;
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = mse;
  o.executor.activation_spec = [](int) { return TensorSpec{{kMbs, kSeq, kDim}, at::kDouble}; };
  return o;
}

void rethrow_any(const PipelineRun& run) {
  for (const auto& e : run.errors) {
    if (e) std::rethrow_exception(e);
  }
}

void expect_parity(const std::string& schedule_name, BackwardMode mode, const ChunkFactory& make,
                   const BeforeStep& before_step = nullptr, const PipelineOptions& o = options()) {
  const Schedule schedule = schedule_for(schedule_name, mode);
  torch::manual_seed(1);
  auto inputs = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  auto targets = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  Reference ref = run_reference(schedule.num_stages, make, inputs, targets, before_step);
  PipelineRun run = run_pipeline(schedule, make, inputs, targets, o, nullptr, nullptr, before_step);
  rethrow_any(run);
  for (int step = 0; step < kSteps; ++step) {
    ASSERT_EQ(run.losses[step].size(), static_cast<std::size_t>(kMicroBatches));
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      EXPECT_NEAR(run.losses[step][mb], ref.losses[step][mb], 1e-12) << "step " << step << " micro-batch " << mb;
    }
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    const std::string mismatch = compare_modules(*run.chunks[s], *ref.chunks[s], 1e-10);
    EXPECT_TRUE(mismatch.empty()) << "stage " << s << ": " << mismatch;
  }
}

struct ParityCase {
  ModuleClass cls;
  std::string schedule;
  BackwardMode mode;
};

class ModuleClassParity : public ::testing::TestWithParam<ParityCase> {
 protected:
  Float64Default float64_;
};

TEST_P(ModuleClassParity, GradientsBuffersAndExtrasMatchLossBackward) {
  const auto& c = GetParam();
  expect_parity(c.schedule, c.mode, [&](int) { return c.cls.make(kDim); });
}

std::string test_name(const std::string& a, const std::string& schedule, BackwardMode m) {
  std::string n = a + "_" + schedule + "_" + to_string(m);
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

std::vector<ParityCase> parity_cases() {
  std::vector<ParityCase> out;
  for (const auto& cls : supported_module_classes()) {
    for (const auto& s : builtin_schedule_names()) {
      for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) out.push_back({cls, s, m});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Classes, ModuleClassParity, ::testing::ValuesIn(parity_cases()), [](const auto& info) {
  return test_name(info.param.cls.name, info.param.schedule, info.param.mode);
});

struct ScheduleMode {
  std::string schedule;
  BackwardMode mode;
};

class PipelineSplitCases : public ::testing::TestWithParam<ScheduleMode> {
 protected:
  Float64Default float64_;
};

/// Every class in one pipeline, one after the other (stage s runs class s mod #classes).
TEST_P(PipelineSplitCases, MixedClassesInOnePipeline) {
  const auto classes = supported_module_classes();
  expect_parity(GetParam().schedule, GetParam().mode,
                [&](int s) { return classes[(s + 3) % classes.size()].make(kDim); });
}

/// A first stage whose fast Embedding feeds general layers; later stages of the other classes.
struct EmbeddingFirst : CaseModule {
  EmbeddingFirst() {
    embed = register_module("embed", twobp::nn::Embedding(11, kDim));
    general = register_module("general", torch::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return general(embed(x.select(-1, 0).abs().mul(3).floor().clamp_max(10).to(torch::kLong)));
  }
  twobp::nn::Embedding embed{nullptr};
  torch::nn::Linear general{nullptr};
};

TEST_P(PipelineSplitCases, FastEmbeddingFirstStageFeedingGeneralLayers) {
  const auto classes = supported_module_classes();
  expect_parity(GetParam().schedule, GetParam().mode, [&](int s) -> std::shared_ptr<CaseModule> {
    if (s == 0) return std::make_shared<EmbeddingFirst>();
    return classes[s % classes.size()].make(kDim);
  });
}

/// Which parameters train may change between steps (freezing a layer after warm-up, unfreezing one for
/// fine-tuning): before step 1 every other tensor of every chunk flips requires_grad -- frozen ones start
/// training, trainable ones stop (their gradient of step 0 stays, as with loss.backward()).
TEST_P(PipelineSplitCases, ParametersFrozenAndUnfrozenBetweenSteps) {
  const auto classes = supported_module_classes();
  expect_parity(
      GetParam().schedule, GetParam().mode, [&](int s) { return classes[(s + 1) % classes.size()].make(kDim); },
      [](int step, CaseModule& chunk) {
        if (step != 1) return;
        bool flip = true;
        for (auto& p : unique_tensors(chunk.parameters())) {
          if (flip) p.set_requires_grad(!p.requires_grad());
          flip = !flip;
        }
      });
}

/// Leading stages with every parameter frozen (a frozen encoder or embedding): their outputs carry no gradient,
/// so their I and W do nothing and nothing flows into them. With specs that say so (requires_grad false on their
/// boundaries) and with announced shapes; the first stage alone frozen, and the first two.
TEST_P(PipelineSplitCases, LeadingStagesEntirelyFrozen) {
  const auto classes = supported_module_classes();
  // Classes whose every trainable tensor is registered (UnregisteredLeaves' free leaves would still train).
  const std::vector<std::string> frozen_classes = {"RegisteredTwice", "StageDropout", "Normalized"};
  const int stages = schedule_for(GetParam().schedule, GetParam().mode).num_stages;
  for (int frozen : {1, 2}) {
    if (frozen >= stages) continue;  // the last stage trains (LossWithoutGradientIsRefused)
    for (bool spec : {true, false}) {
      SCOPED_TRACE(std::to_string(frozen) + " frozen stage(s), " + (spec ? "specs" : "announced shapes"));
      PipelineOptions o = options();
      o.executor.activation_spec = nullptr;
      if (spec) {
        o.executor.activation_spec = [frozen](int s) {
          return TensorSpec{{kMbs, kSeq, kDim}, at::kDouble, "", /*requires_grad=*/s >= frozen};
        };
      }
      expect_parity(
          GetParam().schedule, GetParam().mode,
          [&](int s) -> std::shared_ptr<CaseModule> {
            if (s >= frozen) return classes[(s + 1) % classes.size()].make(kDim);
            const std::string name = frozen_classes[s % frozen_classes.size()];
            for (const auto& c : classes) {
              if (c.name != name) continue;
              auto m = c.make(kDim);
              for (auto& p : m->parameters()) p.set_requires_grad(false);
              return m;
            }
            throw std::logic_error("no split class " + name);
          },
          nullptr, o);
    }
  }
}

/// A first stage whose output depends on its parameters only for some micro-batches (the others pass the data
/// through): those micro-batches send no gradient into it (announced shapes; a fixed spec says every micro-batch
/// carries one, and refuses the others).
struct SometimesConstant : CaseModule {
  SometimesConstant() { lin = register_module("lin", torch::nn::Linear(kDim, kDim)); }
  torch::Tensor forward(const torch::Tensor& x) override {
    return x.index({0, 0, 0}).item<double>() < 0 ? x * 2.0 : torch::tanh(lin(x)) + x;
  }
  torch::nn::Linear lin{nullptr};
};

TEST_P(PipelineSplitCases, FirstStageWithoutGradientInSomeMicroBatches) {
  {
    torch::manual_seed(1);  // expect_parity's inputs: micro-batches of both kinds
    const auto first = torch::randn({kMicroBatches * kMbs, kSeq, kDim}).select(1, 0).select(1, 0).slice(0, 0, {}, kMbs);
    ASSERT_TRUE((first < 0).any().item<bool>() && (first >= 0).any().item<bool>()) << first;
  }
  const auto classes = supported_module_classes();
  PipelineOptions o = options();
  o.executor.activation_spec = nullptr;
  expect_parity(
      GetParam().schedule, GetParam().mode,
      [&](int s) -> std::shared_ptr<CaseModule> {
        if (s == 0) return std::make_shared<SometimesConstant>();
        return classes[(s + 2) % classes.size()].make(kDim);
      },
      nullptr, o);
}

/// Stages without parameters: the identity (its output is its input, the received tensor itself) and a pure
/// function of its input; and a stage whose output does not depend on its input (a learned tensor plus a detached
/// copy of the input), so that no gradient reaches the stages before it. Each on the even and on the odd stages,
/// the other stages of the split classes; announced shapes (the identity on stage 0 passes data on, which carries
/// no gradient, and a fixed spec would say it does).
struct Identity : CaseModule {
  torch::Tensor forward(const torch::Tensor& x) override { return x; }
};
struct ParameterFree : CaseModule {
  torch::Tensor forward(const torch::Tensor& x) override { return torch::sin(x) * 2.0 + x; }
};
struct IgnoresItsInput : CaseModule {
  IgnoresItsInput() { w = register_parameter("w", torch::randn({kMbs, kSeq, kDim})); }
  torch::Tensor forward(const torch::Tensor& x) override { return torch::tanh(w) + x.detach() * 0.5; }
  torch::Tensor w;
};

TEST_P(PipelineSplitCases, StagesWithoutParametersOrIgnoringTheirInput) {
  const auto classes = supported_module_classes();
  const std::vector<std::pair<std::string, std::function<std::shared_ptr<CaseModule>()>>> odd = {
      {"Identity", [] { return std::make_shared<Identity>(); }},
      {"ParameterFree", [] { return std::make_shared<ParameterFree>(); }},
      {"IgnoresItsInput", [] { return std::make_shared<IgnoresItsInput>(); }}};
  PipelineOptions o = options();
  o.executor.activation_spec = nullptr;
  for (const auto& [name, make] : odd) {
    for (int parity : {0, 1}) {
      SCOPED_TRACE(name + (parity == 0 ? " on the even stages" : " on the odd stages"));
      expect_parity(
          GetParam().schedule, GetParam().mode,
          [&](int s) -> std::shared_ptr<CaseModule> {
            if (s % 2 == parity) return make();
            return classes[(s + 1) % classes.size()].make(kDim);
          },
          nullptr, o);
    }
  }
}

// Every parameter frozen: the loss carries no gradient and the step would train nothing. loss.backward() refuses
// that; so does the pipeline, at the last stage's first F.
TEST(RankThreads, LossWithoutGradientIsRefused) {
  Float64Default float64;
  torch::manual_seed(1);
  auto inputs = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  auto targets = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  PipelineOptions o = options();
  o.executor.activation_spec = nullptr;
  PipelineRun run = run_pipeline(schedule_for("1f1b", BackwardMode::kSplit),
                                 [](int) -> std::shared_ptr<CaseModule> {
                                   auto m = std::make_shared<RegisteredTwice>(kDim);
                                   for (auto& p : m->parameters()) p.set_requires_grad(false);
                                   return m;
                                 },
                                 inputs, targets, o);
  expect_error<UsageError>([&] { rethrow_any(run); },
                           {"rank 1 stage 1 micro-batch 0", "the loss does not depend on any trainable parameter"});
}

std::vector<ScheduleMode> schedule_modes() {
  std::vector<ScheduleMode> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) out.push_back({s, m});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineSplitCases, ::testing::ValuesIn(schedule_modes()),
                         [](const auto& info) { return test_name("", info.param.schedule, info.param.mode); });

// Whether two runs computed bitwise the same: losses, and every stage's gradients and buffers.
bool bitwise_equal(const PipelineRun& a, const PipelineRun& b) {
  if (a.losses != b.losses) return false;
  for (std::size_t s = 0; s < a.chunks.size(); ++s) {
    auto pa = a.chunks[s]->parameters(), pb = b.chunks[s]->parameters();
    for (std::size_t k = 0; k < pa.size(); ++k) {
      if (pa[k].grad().defined() != pb[k].grad().defined()) return false;
      if (pa[k].grad().defined() && !at::equal(pa[k].grad(), pb[k].grad())) return false;
    }
    auto ba = a.chunks[s]->buffers(), bb = b.chunks[s]->buffers();
    for (std::size_t k = 0; k < ba.size(); ++k) {
      if (!at::equal(ba[k], bb[k])) return false;
    }
  }
  return true;
}

// Ranks as threads draw dropout masks from their stages' own streams (twobp/random.h): 20 runs of each setup --
// recomputation on no stage, on the odd stages, on every stage -- give bitwise the same losses, gradients and
// buffers, equal to the single-process loss.backward() reference. (Before, with torch::nn::Dropout, the rank
// threads' draws from LibTorch's one generator interleaved differently in 5-7 of 7 runs, and recomputation,
// which saved and restored that generator, changed other ranks' masks in 1-7 of 12; such forwards are now
// refused, see below.) Stages alternate dropout and BatchNorm/InstanceNorm (buffers updated in forward).
TEST(RankThreads, DropoutIsReproducibleAndExactWithAndWithoutRecomputation) {
  Float64Default f;
  ChunkFactory make = [](int s) -> std::shared_ptr<CaseModule> {
    if (s % 2 == 0) return std::make_shared<StageDropout>(kDim);
    return std::make_shared<Normalized>(kDim);
  };
  torch::manual_seed(1);
  auto inputs = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  auto targets = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  const std::vector<std::pair<std::string, std::function<bool(int)>>> recomputes = {
      {"none", [](int) { return false; }}, {"odd stages", [](int s) { return s % 2 == 1; }},
      {"every stage", [](int) { return true; }}};
  for (const auto& [name, mode] : std::vector<std::pair<std::string, BackwardMode>>{
           {"1f1b", BackwardMode::kSplit}, {"zb-v", BackwardMode::kSplit}, {"interleaved-1f1b", BackwardMode::kStandard}}) {
    const Schedule schedule = schedule_for(name, mode);
    Reference ref = run_reference(schedule.num_stages, make, inputs, targets);
    for (const auto& [where, recompute] : recomputes) {
      SCOPED_TRACE(name + ", recomputation on " + where);
      PipelineRun first;
      for (int run_index = 0; run_index < 20; ++run_index) {
        PipelineRun run = run_pipeline(schedule, make, inputs, targets, options(), nullptr, recompute);
        rethrow_any(run);
        if (run_index == 0) {
          for (int s = 0; s < schedule.num_stages; ++s) {
            const std::string mismatch = compare_modules(*run.chunks[s], *ref.chunks[s], 1e-10);
            EXPECT_TRUE(mismatch.empty()) << "stage " << s << ": " << mismatch;
          }
          first = std::move(run);
          continue;
        }
        ASSERT_TRUE(bitwise_equal(run, first)) << "run " << run_index << " differs from the first";
      }
    }
  }
}

/// torch::nn::Dropout draws from LibTorch's process-wide generator.
struct TorchDropout : CaseModule {
  explicit TorchDropout(int64_t dim) {
    fast = register_module("fast", twobp::nn::Linear(dim, dim));
    drop = register_module("drop", torch::nn::Dropout(0.4));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return drop(fast(x)) + x; }
  twobp::nn::Linear fast{nullptr};
  torch::nn::Dropout drop{nullptr};
};

// Ranks as threads: a forward drawing from LibTorch's default generator is refused on its first micro-batch,
// naming rank, stage and micro-batch and what to use instead -- with and without recomputation. One rank alone in
// its process may draw from it (the rank's draws are then in schedule order).
TEST(RankThreads, DefaultGeneratorDrawsAreRefusedWhenRanksShareTheProcess) {
  Float64Default f;
  torch::manual_seed(1);
  auto inputs = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  auto targets = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  ChunkFactory make = [](int s) -> std::shared_ptr<CaseModule> {
    if (s == 1) return std::make_shared<TorchDropout>(kDim);
    return std::make_shared<StageDropout>(kDim);
  };
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "with recomputation" : "without recomputation");
    const Schedule schedule = schedule_for("1f1b", BackwardMode::kSplit);
    PipelineRun run = run_pipeline(schedule, make, inputs, targets, options(), nullptr,
                                   [recompute](int) { return recompute; });
    const int owner = schedule.stage_to_rank[1];
    ASSERT_TRUE(run.errors[owner] != nullptr) << "rank " << owner << " ran torch::nn::Dropout without an error";
    try {
      std::rethrow_exception(run.errors[owner]);
    } catch (const UsageError& e) {
      const std::string what = e.what();
      for (const char* part : {"rank 1 stage 1 micro-batch 0", "default random generator", "twobp::nn::Dropout",
                               "one rank per process"}) {
        EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected a UsageError, got: " << e.what();
    }
  }
  const Schedule alone = make_schedule("1f1b", default_schedule_options("1f1b", 1, kMicroBatches, BackwardMode::kSplit));
  ChunkFactory torch_dropout = [](int) -> std::shared_ptr<CaseModule> { return std::make_shared<TorchDropout>(kDim); };
  rethrow_any(run_pipeline(alone, torch_dropout, inputs, targets, options(), nullptr, [](int) { return true; }));
}

/// Running statistics only (a BatchNorm without affine parameters) in a module given to it, which chunks of two
/// ranks may share.
struct WithStatistics : CaseModule {
  explicit WithStatistics(torch::nn::BatchNorm1d shared) {
    norm = register_module("norm", std::move(shared));
    fast = register_module("fast", twobp::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return norm(fast(x).transpose(1, 2)).transpose(1, 2) + x; }
  torch::nn::BatchNorm1d norm{nullptr};
  twobp::nn::Linear fast{nullptr};
};

// Ranks as threads: a tensor shared by chunks of two ranks -- a weight tied across ranks, or a module (here one
// holding only buffers) given to two ranks -- would be written from two threads, counted twice in the gradient
// norm, clipped twice and stepped by both ranks' optimizers. Refused on the first step, before any micro-batch,
// naming the tensor, both stages and what to do -- for every built-in schedule and mode, between stage 0 and the
// first stage on another rank. (A tie between two stages of one rank is supported: PipelineGradientNorm below.)
TEST(RankThreads, TensorSharedByTwoRanksIsRefused) {
  Float64Default f;
  torch::manual_seed(1);
  auto inputs = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  auto targets = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (bool buffers : {false, true}) {
        SCOPED_TRACE(name + " " + to_string(mode) + (buffers ? ", a module of buffers shared" : ", a tied weight"));
        const Schedule schedule = schedule_for(name, mode);
        int other = 1;
        while (schedule.stage_to_rank[other] == schedule.stage_to_rank[0]) ++other;
        std::shared_ptr<RegisteredTwice> first;
        torch::nn::BatchNorm1d statistics(torch::nn::BatchNorm1dOptions(kDim).affine(false));
        ChunkFactory make = [&](int s) -> std::shared_ptr<CaseModule> {
          if (buffers) {
            return std::make_shared<WithStatistics>(
                s == 0 || s == other ? statistics : torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(kDim)));
          }
          auto m = std::make_shared<RegisteredTwice>(kDim);
          if (s == 0) first = m;
          if (s == other) m->fast->tie_weight(first->fast->weight);
          return m;
        };
        PipelineRun run = run_pipeline(schedule, make, inputs, targets, options());
        RankErrors errors{run.errors};
        for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(errors.errors[r] != nullptr) << "rank " << r << " ran its steps";
        expect_error<UsageError>([&] { errors.rethrow_root_cause(); },
                                 {buffers ? "buffer 'norm.running_mean' of stage" : "parameter 'fast.weight' of stage",
                                  "threads", "PipelineOptions::tied_parameters"});
        EXPECT_TRUE(run.losses[0].empty()) << "a micro-batch ran";
      }
    }
  }
}

torch::Tensor dense(const torch::Tensor& t) { return t.is_sparse() ? t.to_dense() : t; }

/// Norms and clipping see each tensor once: a submodule registered twice in every chunk, and on zb-v one weight
/// tied between the first and the last stage, which share rank 0; sparse gradients (an Embedding with
/// sparse=true) count each row once however many times it was looked up.
TEST(PipelineGradientNorm, CountsEachTensorOnceAndClipsItOnce) {
  Float64Default f;
  for (const char* name : {"1f1b", "zb-v"}) {
    for (bool sparse : {false, true}) {
      SCOPED_TRACE(std::string(name) + (sparse ? " with sparse gradients" : ""));
      const Schedule schedule = schedule_for(name, BackwardMode::kSplit);
      const int last = schedule.num_stages - 1;
      // Where stage 0 and the last stage share a rank, they share one weight (created once per build of the
      // pipeline or of the reference). Across ranks a tie would be two tensors, one per process.
      const bool tie = schedule.stage_to_rank[0] == schedule.stage_to_rank[last];
      std::shared_ptr<RegisteredTwice> first;
      ChunkFactory make = [&](int s) -> std::shared_ptr<CaseModule> {
        if (sparse && s % 2 == 1) return std::make_shared<TorchZoo>(kDim);
        auto m = std::make_shared<RegisteredTwice>(kDim);
        if (s == 0) first = m;
        if (s == last && tie && first) m->fast->tie_weight(first->fast->weight);
        return m;
      };
      torch::manual_seed(1);
      auto inputs = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
      auto targets = torch::randn({kMicroBatches * kMbs, kSeq, kDim});
      Reference ref = run_reference(schedule.num_stages, make, inputs, targets);
      double ref_sq = 0.0;
      std::vector<torch::Tensor> ref_params;
      for (auto& c : ref.chunks) {
        for (auto& p : c->parameters()) ref_params.push_back(p);
      }
      for (auto& p : unique_tensors(ref_params)) ref_sq += dense(p.grad()).pow(2).sum().item<double>();
      const double ref_norm = std::sqrt(ref_sq);
      const double max_norm = ref_norm / 4;

      std::vector<double> clipped_norms(kRanks);
      PipelineRun run = run_pipeline(schedule, make, inputs, targets, options(), [&](Pipeline& p) {
        clipped_norms[p.rank()] = p.clip_grad_norm(max_norm);
      });
      rethrow_any(run);
      for (int r = 0; r < kRanks; ++r) EXPECT_NEAR(clipped_norms[r], ref_norm, 1e-9 * ref_norm) << "rank " << r;
      const double factor = max_norm / (ref_norm + 1e-6);
      for (int s = 0; s < schedule.num_stages; ++s) {
        for (const auto& item : ref.chunks[s]->named_parameters()) {
          const auto got = dense(run.chunks[s]->named_parameters()[item.key()].grad());
          EXPECT_LE((got - dense(item.value().grad()) * factor).abs().max().item<double>(), 1e-10)
              << "stage " << s << " " << item.key() << " is not clipped exactly once";
        }
      }
    }
  }
}

}  // namespace
}  // namespace twobp::testing
