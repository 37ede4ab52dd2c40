// Stage boundaries of several named tensors, with and without gradients, and of shapes that change per
// micro-batch and per step: every schedule x {standard, 2BP}, ranks as threads on the Local transport (by tag,
// and in order per channel as NCCL pairs), against one process running the same chunks (float64, every
// parameter's .grad, defined vs undefined). Also the errors: spec mismatches, a gradient fixed specs cannot
// carry, name clashes, oversized headers.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/boundary_cases.h"
#include "common/expect_error.h"
#include "common/test_scale.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/stage.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

struct BoundaryRun {
  std::vector<std::map<int, BoundaryChunk>> modules;  // per rank
  std::vector<std::vector<StepResult>> results;       // per rank, per step
  RankErrors errors;
};

BoundaryRun run_boundary_pipeline(const Schedule& schedule, bool aux, const std::vector<BoundaryBatch>& steps,
                                  PipelineOptions options, Pairing pairing = Pairing::kByTag,
                                  bool recompute = false) {
  LocalOptions lo;
  lo.pairing = pairing;
  auto transports = make_local_transports(schedule.num_ranks, lo);
  BoundaryRun run;
  run.modules.resize(schedule.num_ranks);
  run.results.resize(schedule.num_ranks);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  std::vector<Transport*> raw;
  for (int r = 0; r < schedule.num_ranks; ++r) {
    pipelines.push_back(std::make_unique<Pipeline>(schedule, boundary_chunks(schedule, r, aux, &run.modules[r], recompute),
                                                   *transports[r], options));
    raw.push_back(transports[r].get());
  }
  const int first = schedule.stage_to_rank.front(), last = schedule.stage_to_rank.back();
  run.errors = run_rank_threads(
      raw,
      [&](Transport& t) {
        const int r = t.rank();
        for (const auto& batch : steps) {
          run.results[r].push_back(pipelines[r]->step(r == first ? batch.inputs : std::vector<NamedTensors>{},
                                                      r == last ? batch.targets : std::vector<NamedTensors>{}));
        }
      },
      /*abort_on_error=*/false);
  return run;
}

PipelineOptions boundary_options() {
  PipelineOptions o;
  o.executor.timeout = std::chrono::seconds(60);
  o.loss = boundary_loss;
  return o;
}

struct BoundaryCase {
  std::string schedule;
  BackwardMode mode;
  int p, m;
  Pairing pairing;
  bool fixed_specs;  // else announced shapes, varying per micro-batch and per step, with the "aux" tensor
  bool recompute = false;  // activation recomputation on every stage
};

class BoundaryParity : public ::testing::TestWithParam<BoundaryCase> {
 protected:
  Float64Default float64_;
};

TEST_P(BoundaryParity, LossesAndGradientsMatchSingleProcess) {
  const BoundaryCase c = GetParam();
  Schedule schedule;
  try {
    schedule = make_schedule(c.schedule, default_schedule_options(c.schedule, c.p, c.m, c.mode));
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();
  }
  // Fixed specs cannot say "no gradient reached this tensor" (see the refusal test): no "aux" with them.
  const bool aux = !c.fixed_specs;
  std::vector<BoundaryBatch> steps;
  int seed = 10;
  for (const auto& lengths : boundary_lengths(2, c.m, !c.fixed_specs)) steps.push_back(make_boundary_batch(lengths, seed++));
  BoundaryReference ref = run_boundary_reference(schedule.num_stages, aux, steps);

  PipelineOptions options = boundary_options();
  if (c.fixed_specs) options.executor.boundary_spec = [aux](int) { return boundary_spec(aux); };
  BoundaryRun run = run_boundary_pipeline(schedule, aux, steps, options, c.pairing, c.recompute);
  if (!run.errors.ok()) std::rethrow_exception(run.errors.root_cause());

  const int last = schedule.stage_to_rank.back();
  for (std::size_t i = 0; i < steps.size(); ++i) {
    ASSERT_EQ(run.results[last][i].losses.size(), static_cast<std::size_t>(c.m));
    for (int k = 0; k < c.m; ++k) {
      EXPECT_NEAR(run.results[last][i].losses[k], ref.losses[i][k], 1e-12) << "step " << i << " micro-batch " << k;
    }
  }
  int undefined = 0;
  for (int s = 0; s < schedule.num_stages; ++s) {
    auto& got = *run.modules[schedule.stage_to_rank[s]].at(s);
    EXPECT_EQ(compare_gradients(got, *ref.chunks[s], s), "");
    for (const auto& p : ref.chunks[s]->parameters()) undefined += p.grad().defined() ? 0 : 1;
  }
  // The "aux" producers of odd stages feed an even stage that ignores it (from 3 stages on): the case must occur.
  if (aux && schedule.num_stages >= 3) EXPECT_GT(undefined, 0);
}

std::vector<BoundaryCase> boundary_cases() {
  std::vector<BoundaryCase> cases;
  const std::vector<std::pair<int, int>> shapes = {{2, 4}, {4, 8}};
  const std::vector<BackwardMode> modes = {BackwardMode::kStandard, BackwardMode::kSplit};
  // Reduced scale (the sanitizers): each schedule runs one shape per mode, the other shape with the other mode
  // (alternating from schedule to schedule), so that it still meets both shapes and both modes, and every pairing,
  // form of specs and recomputation.
  const std::vector<std::string> names = builtin_schedule_names();
  for (std::size_t n = 0; n < names.size(); ++n) {
    for (std::size_t j = 0; j < modes.size(); ++j) {
      for (std::size_t k = 0; k < shapes.size(); ++k) {
        if (!runs_at_this_scale(n + j + k)) continue;
        const auto [p, m] = shapes[k];
        const std::string& name = names[n];
        const BackwardMode mode = modes[j];
        for (Pairing pairing : {Pairing::kByTag, Pairing::kInOrderPerChannel}) {
          for (bool fixed : {false, true}) cases.push_back({name, mode, p, m, pairing, fixed});
        }
        // Activation recomputation on every stage, announced shapes.
        cases.push_back({name, mode, p, m, Pairing::kByTag, false, true});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, BoundaryParity, ::testing::ValuesIn(boundary_cases()), [](const auto& info) {
  const auto& c = info.param;
  std::string n = c.schedule + (c.mode == BackwardMode::kSplit ? "_2bp" : "_standard") + "_p" + std::to_string(c.p) +
                  "_m" + std::to_string(c.m) + (c.pairing == Pairing::kByTag ? "" : "_in_order") +
                  (c.fixed_specs ? "_fixed_specs" : "_announced_variable") + (c.recompute ? "_recompute" : "");
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

class BoundaryErrors : public ::testing::Test {
 protected:
  Float64Default float64_;
  Schedule schedule_ = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  std::vector<BoundaryBatch> steps_{make_boundary_batch({3, 3}, 1)};

  // Runs the pipeline expecting a UsageError on `rank` whose message holds `words`, and the peer to fail too.
  void expect_failure(const PipelineOptions& options, bool aux, int rank, std::vector<std::string> words) {
    const auto t0 = std::chrono::steady_clock::now();
    BoundaryRun run = run_boundary_pipeline(schedule_, aux, steps_, options);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
    ASSERT_FALSE(run.errors.ok());
    ASSERT_TRUE(run.errors.errors[rank]) << "rank " << rank << " must fail";
    expect_error([&] { std::rethrow_exception(run.errors.errors[rank]); }, words);
    ASSERT_TRUE(run.errors.errors[1 - rank]) << "the peer must fail too, not hang";
  }
};

TEST_F(BoundaryErrors, FixedSpecsRefuseAGradientThatNothingProduced) {
  // Odd stages use their "aux" input, even ones ignore it: four stages on two ranks give an even receiver.
  schedule_ = make_schedule("interleaved-1f1b", default_schedule_options("interleaved-1f1b", 2, 2, BackwardMode::kSplit));
  auto options = boundary_options();
  options.executor.boundary_spec = [](int) { return boundary_spec(true); };
  // Stage 2 (rank 0) receives stage 1's "aux" and ignores it: its SEND_B to stage 1 has no gradient for it.
  expect_failure(options, true, schedule_.stage_to_rank[2],
                 {"no gradient reached input 'aux'", "stage 2", "micro-batch", "requires_grad = false", "no specs"});
}

TEST_F(BoundaryErrors, SpecOfOtherTensorsNamesBothStages) {
  auto options = boundary_options();
  options.executor.boundary_spec = [](int) {
    BoundarySpec spec = boundary_spec(false);
    spec[2].dtype = at::kLong;  // the mask is bool
    return spec;
  };
  expect_failure(options, false, 0, {"stage 0 (rank 0)", "stage 1 (rank 1)", "micro-batch 0", "mask [2, 3] Bool",
                                     "mask [2, 3] Long"});
}

TEST_F(BoundaryErrors, SpecThatDisagreesOnTheGradientNamesTheTensor) {
  auto options = boundary_options();
  options.executor.boundary_spec = [](int) {
    BoundarySpec spec = boundary_spec(false);
    spec[3].requires_grad = false;  // "enc" carries a gradient
    return spec;
  };
  expect_failure(options, false, 0, {"stage 1 (rank 1) expects", "enc [2, 3, 4] Double (no gradient)"});
}

TEST_F(BoundaryErrors, ATargetNamedLikeAnInputIsRefused) {
  auto options = boundary_options();
  for (auto& t : steps_[0].targets) t.add("mask", torch::ones({kBoundaryBatch, 3}, torch::kBool));
  expect_failure(options, false, 1, {"rank 1 stage 1 micro-batch 0", "target 'mask'", "rename"});
}

TEST_F(BoundaryErrors, TooMuchToAnnounceSaysWhatToDo) {
  // Fifteen tensors with 100-character names do not fit the 2 KiB header.
  auto options = boundary_options();
  PipelineOptions o = options;
  auto transports = make_local_transports(2);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  auto lin = std::make_shared<torch::nn::LinearImpl>(kBoundaryDim, kBoundaryDim);
  std::vector<PipelineChunk> c0{{0, lin, [lin](const NamedTensors& in) {
                                   NamedTensors out;
                                   for (int i = 0; i < 15; ++i) {
                                     out.add(std::string(100, static_cast<char>('a' + i)), lin->forward(in["x"]));
                                   }
                                   return out;
                                 }}};
  auto other = std::make_shared<torch::nn::LinearImpl>(kBoundaryDim, kBoundaryDim);  // ranks own disjoint tensors
  std::vector<PipelineChunk> c1{{1, other, [](const NamedTensors& in) { return in.entry(0).tensor; }}};
  pipelines.push_back(std::make_unique<Pipeline>(schedule_, std::move(c0), *transports[0], o));
  pipelines.push_back(std::make_unique<Pipeline>(schedule_, std::move(c1), *transports[1], o));
  RankErrors errors = run_rank_threads(
      transports,
      [&](Transport& t) {
        pipelines[t.rank()]->step(t.rank() == 0 ? steps_[0].inputs : std::vector<NamedTensors>{},
                                  t.rank() == 1 ? steps_[0].targets : std::vector<NamedTensors>{});
      },
      false);
  ASSERT_TRUE(errors.errors[0]);
  expect_error([&] { std::rethrow_exception(errors.errors[0]); },
                     {"rank 0", "SEND_F stage 0 micro-batch 0", "header slots", "give activation specs"});
  EXPECT_TRUE(errors.errors[1]);
}

// Stage 1 of 3: its inputs get gradients, its outputs need them.
StageOptions middle_stage() {
  StageOptions so;
  so.stage_index = 1;
  so.num_stages = 3;
  return so;
}

TEST(StageTensors, AMissingNameInTheForwardSaysWhereAndWhatThereIs) {
  Float64Default float64;
  auto lin = std::make_shared<torch::nn::LinearImpl>(2, 2);
  StageOptions so;
  so.stage_index = 2;
  so.rank = 1;
  Stage stage(lin, [lin](const NamedTensors& in) { return NamedTensors{{"h", lin->forward(in["hidden"])}}; }, so);
  expect_error([&] { stage.forward(3, NamedTensors{{"h", torch::randn({1, 2})}}, NamedTensors()); },
               {"rank 1 stage 2 micro-batch 3", "no tensor named 'hidden'", "h [1, 2] Double"});
}

TEST(StageTensors, OneTensorFormsRefuseSeveralTensorsNamingThem) {
  Float64Default float64;
  auto lin = std::make_shared<torch::nn::LinearImpl>(2, 2);
  const StageOptions so = middle_stage();
  Stage stage(lin, [lin](const at::Tensor& x) { return lin->forward(x); }, so);
  NamedTensors in{{"h", torch::randn({1, 2}, torch::kDouble)}, {"mask", torch::ones({1, 2})}};
  expect_error([&] { stage.forward(0, in, NamedTensors()); },
                     {"stage 1 micro-batch 0", "exactly one tensor", "h [1, 2] Double", "NamedTensors"});
}

TEST(StageTensors, GradientsNameOutputsAndUndefinedMeansNone) {
  // Directly on a Stage: I with a gradient for one of two outputs equals backward() of that output alone, and the
  // input that only the other output depends on gets an undefined gradient.
  Float64Default float64;
  torch::manual_seed(3);
  auto lin = std::make_shared<torch::nn::LinearImpl>(3, 3);
  const StageOptions so = middle_stage();
  Stage stage(lin,
              [lin](const NamedTensors& in) {
                return NamedTensors{{"p", lin->forward(in["u"])}, {"q", in["v"] * 2.0}};
              },
              so);
  auto u = torch::randn({2, 3}), v = torch::randn({2, 3}), g = torch::randn({2, 3});
  NamedTensors out = stage.forward(0, NamedTensors{{"u", u.requires_grad_(true)}, {"v", v.requires_grad_(true)}},
                                   NamedTensors());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out["p"].requires_grad());
  expect_error([&] { stage.backward_input(0, NamedTensors{{"z", g}}); }, {"'z'", "not an output", "p", "q"});
  NamedTensors grads = stage.backward_input(0, NamedTensors{{"p", g}, {"q", at::Tensor()}});
  stage.backward_weight({0});
  ASSERT_EQ(grads.size(), 2u);
  EXPECT_FALSE(grads["v"].defined());
  auto u2 = u.detach().clone().requires_grad_(true);
  auto lin2 = std::make_shared<torch::nn::LinearImpl>(3, 3);
  torch::NoGradGuard ng;
  lin2->weight.copy_(lin->weight);
  lin2->bias.copy_(lin->bias);
  {
    torch::AutoGradMode on(true);
    lin2->forward(u2).backward(g);
  }
  EXPECT_TRUE(torch::allclose(grads["u"], u2.grad(), 0, 1e-12));
  EXPECT_TRUE(torch::allclose(lin->weight.grad(), lin2->weight.grad(), 0, 1e-12));
}

TEST(StageTensors, OneTensorUnderTwoNamesSumsBothGradients) {
  // The same output under two names (and an input passed straight through): both gradients reach the producer.
  Float64Default float64;
  torch::manual_seed(4);
  auto lin = std::make_shared<torch::nn::LinearImpl>(3, 3);
  const StageOptions so = middle_stage();
  for (bool split : {true, false}) {
    Stage stage(lin,
                [lin](const NamedTensors& in) {
                  at::Tensor y = lin->forward(in["u"]);
                  return NamedTensors{{"a", y}, {"b", y}, {"u", in["u"]}};
                },
                so);
    lin->zero_grad();
    auto u = torch::randn({2, 3}), ga = torch::randn({2, 3}), gb = torch::randn({2, 3}), gu = torch::randn({2, 3});
    stage.forward(0, NamedTensors{{"u", u.clone().requires_grad_(true)}}, NamedTensors());
    const NamedTensors grads{{"a", ga}, {"b", gb}, {"u", gu}};
    NamedTensors got = split ? stage.backward_input(0, grads) : stage.backward(0, grads);
    if (split) stage.backward_weight({0});
    const at::Tensor weight_grad = lin->weight.grad().clone();
    lin->zero_grad();
    auto u2 = u.clone().requires_grad_(true);
    at::Tensor y = lin->forward(u2);
    torch::autograd::backward({y, y, u2 * 1.0}, {ga, gb, gu});
    EXPECT_TRUE(torch::allclose(got["u"], u2.grad(), 0, 1e-12)) << (split ? "2BP" : "fused");
    EXPECT_TRUE(torch::allclose(weight_grad, lin->weight.grad(), 0, 1e-12)) << (split ? "2BP" : "fused");
  }
}

}  // namespace
}  // namespace twobp::testing
