// PipelineOptions::tied_parameters: an input embedding on the first stage tied to the output head on the last (as
// a tied LLaMa's), held as two copies -- on two ranks, on one rank (zb-v), with ranks in between that hold none, over
// 2 replicas -- against one process's model whose head IS its embedding, in float64: the loss, every parameter's
// .grad (each copy's the tied weight's), the gradient norm (counted once), and the weights after clipped AdamW
// steps (the copies stay one weight). Construction gives the head the embedding's values; malformed ties are
// refused on every rank. Part of pipeline_test.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/test_models.h"
#include "common/tied_cases.h"
#include "twobp/error.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

using namespace tied;  // NOLINT(google-build-using-namespace): the shared cases of this test

// dp replicas of `ranks` pipeline ranks under `name`, the tie declared, kSteps clipped AdamW steps.
Outcome run_tied(const std::string& name, BackwardMode mode, int ranks, int v, int micro_batches, int dp) {
  const Schedule schedule = make_schedule(name, ScheduleOptions{ranks, micro_batches, v, mode});
  const int stages = schedule.num_stages;
  const int64_t share = kSequences / dp, mbs = share / micro_batches;
  auto transports = make_local_transports(ranks * dp);
  std::vector<std::vector<TiedChunk>> built(ranks * dp);  // built here: one generator, one thread
  for (int w = 0; w < ranks * dp; ++w) {
    for (int s : schedule.stages_of(w % ranks)) built[w].emplace_back(s, stages);
  }
  const Batch b = batch();
  Outcome out;
  std::mutex mutex;
  const RankErrors errors = run_rank_threads(transports, [&](Transport& world) {
    ParallelGroups groups(world, dp, std::chrono::seconds(60));
    const int r = groups.pipeline_rank(), replica = groups.replica();
    PipelineOptions o = tied_options(stages, mbs);
    o.data_parallel.group = groups.data_parallel();
    std::vector<PipelineChunk> mine;
    const std::vector<int> my_stages = schedule.stages_of(r);
    for (std::size_t k = 0; k < my_stages.size(); ++k) {
      TiedChunk c = built[world.rank()][k];
      mine.push_back({my_stages[k], c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }});
    }
    Pipeline pipeline(schedule, std::move(mine), groups.pipeline(), o);
    torch::optim::AdamW adam(pipeline.parameters(), torch::optim::AdamWOptions(kLr));
    const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, replica * share, share); };
    const bool first = schedule.stage_to_rank[0] == r, last = schedule.stage_to_rank[stages - 1] == r;
    for (int step = 0; step < kSteps; ++step) {
      pipeline.zero_grad();
      const StepResult result = pipeline.step(first ? NamedTensors(rows(b.ids)) : NamedTensors(),
                                              last ? NamedTensors(rows(b.targets)) : NamedTensors());
      const double loss = pipeline.mean_loss(result);
      ASSERT_TRUE(pipeline.ready_for_optimizer(step, NonFinitePolicy::kStop, kMaxNorm));
      std::lock_guard<std::mutex> lock(mutex);
      if (step == 0 && replica == 0) {
        out.loss = loss;
        out.norm = pipeline.last_gradient_check().norm;
        record(out.grads, my_stages, built[world.rank()], /*grads=*/true);
      }
      adam.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (replica == 0) record(out.weights, my_stages, built[world.rank()], /*grads=*/false);
  });
  if (!errors.ok()) errors.rethrow_root_cause();
  return out;
}

TEST(TiedParameters, CopiesOnTwoStagesTrainAsTheTiedWeight) {
  Float64Default float64;
  struct Case {
    std::string name;
    int ranks, v, dp;
  };
  // Copies on two ranks; on one rank (zb-v: stages 0 and 3 on rank 0); with ranks that hold none (4 ranks);
  // interleaved (stage 3 on rank 1); over 2 replicas.
  for (const Case& c : std::vector<Case>{{"1f1b", 2, 1, 1}, {"zb-v", 2, 2, 1}, {"1f1b", 4, 1, 1},
                                         {"interleaved-1f1b", 2, 2, 1}, {"zb-h1", 2, 1, 2}}) {
    for (const BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
      SCOPED_TRACE(c.name + " " + to_string(mode) + " ranks " + std::to_string(c.ranks) + " dp " +
                   std::to_string(c.dp));
      const int stages = c.ranks * c.v, m = 2;
      const Outcome ref = reference(stages, m * c.dp);
      expect_same(run_tied(c.name, mode, c.ranks, c.v, m, c.dp), ref, stages);
    }
  }
}

// Each rank's Pipeline over `ties`; returns the error of rank 0 (every rank must fail).
void expect_refused(const std::vector<TiedParameter>& ties, const std::vector<std::string>& words) {
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  std::vector<TiedChunk> chunks{TiedChunk(0, 2), TiedChunk(1, 2)};
  if (ties.size() == 1 && ties[0].name == "shape") {
    chunks[1]->head->weight.set_data(torch::zeros({kVocab, kWidth + 1}));
  }
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    PipelineOptions o;
    o.loss = token_loss;
    o.executor.timeout = std::chrono::seconds(60);
    o.tied_parameters = ties;
    TiedChunk c = chunks[t.rank()];
    std::vector<PipelineChunk> mine{{t.rank(), c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }}};
    Pipeline pipeline(schedule, std::move(mine), t, o);
  });
  ASSERT_FALSE(errors.ok());
  std::string messages;  // every rank fails, none waits; one says what is wrong
  bool found = false;
  for (const auto& e : errors.errors) {
    ASSERT_TRUE(e != nullptr) << "a rank did not fail";
    try {
      std::rethrow_exception(e);
    } catch (const UsageError& u) {
      const std::string what = u.what();
      messages += what + "\n";
      bool all = true;
      for (const auto& w : words) all = all && what.find(w) != std::string::npos;
      found = found || all;
    } catch (const std::exception& other) {
      messages += std::string(other.what()) + "\n";
    }
  }
  EXPECT_TRUE(found) << "no rank's UsageError holds every one of the words; they said:\n" << messages;
}

TEST(TiedParameters, MalformedTiesAreRefusedOnEveryRank) {
  expect_refused({{"one", {{0, "embed.weight"}}}}, {"'one'", "at least two"});
  expect_refused({{"twice", {{0, "embed.weight"}, {0, "mix.weight"}}}}, {"stage 0 is listed twice"});
  expect_refused({{"far", {{0, "embed.weight"}, {5, "head.weight"}}}}, {"stage 5 is not a stage"});
  expect_refused({{"typo", {{0, "embed.weight"}, {1, "head.weigth"}}}}, {"rank 1", "no parameter 'head.weigth'"});
  expect_refused({{"shape", {{0, "embed.weight"}, {1, "head.weight"}}}}, {"'shape'", "copies differ", "shape [7, 5]"});
}

TEST(TiedParameters, ConstructionGivesEveryCopyTheFirstCopysValues) {
  Float64Default float64;
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  std::vector<TiedChunk> chunks{TiedChunk(0, 2), TiedChunk(1, 2)};
  ASSERT_FALSE(torch::equal(chunks[0]->embed->weight, chunks[1]->head->weight));
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    PipelineOptions o;
    o.loss = token_loss;
    o.executor.timeout = std::chrono::seconds(60);
    o.tied_parameters = embedding_tie(2);
    TiedChunk c = chunks[t.rank()];
    std::vector<PipelineChunk> mine{{t.rank(), c.ptr(), [c](const at::Tensor& x) mutable { return c->forward(x); }}};
    Pipeline pipeline(schedule, std::move(mine), t, o);
  });
  if (!errors.ok()) errors.rethrow_root_cause();
  EXPECT_TRUE(torch::equal(chunks[0]->embed->weight, chunks[1]->head->weight));
}

}  // namespace
}  // namespace twobp::testing
