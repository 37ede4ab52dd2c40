// The placement search (twobp/plan/placement.h): the LLaMa planner's forms of other placements ranked from a run's
// costs, and the search that measures the fastest predicted with the trial loop and keeps the fastest measured,
// switching forms of one placement itself and asking the program to move to another.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/expect_error.h"
#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/models/llama_rank.h"
#include "twobp/plan/placement.h"
#include "twobp/runtime/launch.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

const models::LlamaConfig& tiny() {
  static const models::LlamaConfig config = models::config_by_name("tiny");
  return config;
}

// `name`'s `mode` form on 2 ranks, 4 micro-batches, `v` stages per rank, the tiny model's layers balanced over them.
Placement placement(const std::string& name, int v, BackwardMode mode, std::vector<int> recompute = {}) {
  Placement p;
  p.schedule = make_schedule(name, ScheduleOptions{2, 4, v, mode});
  p.partition = models::make_partition(tiny(), p.schedule.num_stages, tiny().max_seq_len);
  p.recompute_ranks = std::move(recompute);
  return p;
}

MeasuredCosts split_costs(int stages) {
  MeasuredCosts c;
  c.forward.assign(stages, 1.0);
  c.backward_input.assign(stages, 1.2);
  c.backward_weight.assign(stages, 0.8);
  c.backward.assign(stages, 0.0);  // as AutoSchedule::measured_costs without a standard probe
  c.communication = 0.05;
  return c;
}

TEST(Placement, IsTheStagesOnTheRanksAndTheirLayers) {
  const Placement a = placement("1f1b", 1, BackwardMode::kSplit);
  EXPECT_TRUE(same_placement(a, placement("1f1b", 1, BackwardMode::kStandard, {0})));
  EXPECT_FALSE(same_placement(a, placement("interleaved-1f1b", 2, BackwardMode::kSplit)));
  Placement other_layers = a;
  other_layers.partition = models::make_partition(tiny(), 2, tiny().max_seq_len, "1,3");
  EXPECT_FALSE(same_placement(a, other_layers));
  EXPECT_EQ(describe(a), fmt::format("1f1b 2bp (1 chunk(s) per rank, layers {})", a.partition.layout()));
  EXPECT_NE(describe(placement("1f1b", 1, BackwardMode::kSplit, {0, 1})).find("recomputing on ranks 0,1"),
            std::string::npos);
}

TEST(RankLlamaPlacements, RanksTheOtherPlacementsFastestFirst) {
  const Placement current = placement("1f1b", 1, BackwardMode::kSplit);
  PlacementPlanOptions o;
  o.seq = tiny().max_seq_len;
  o.micro_batch_size = 2;
  o.communication_ms = 0.05;
  const PlacementRanking ranking = rank_llama_placements(tiny(), current, split_costs(2), o);
  ASSERT_FALSE(ranking.others.empty()) << ranking.why_none;
  EXPECT_GT(ranking.current_ms, 0.0);
  EXPECT_FALSE(ranking.fit.empty());
  for (std::size_t k = 0; k < ranking.others.size(); ++k) {
    const PlacementCandidate& c = ranking.others[k];
    EXPECT_FALSE(same_placement(c.placement, current)) << describe(c.placement);
    EXPECT_EQ(c.placement.schedule.num_ranks, 2);
    EXPECT_EQ(c.placement.schedule.num_micro_batches, 4);
    EXPECT_EQ(c.placement.partition.chunks.size(), static_cast<std::size_t>(c.placement.schedule.num_stages));
    EXPECT_TRUE(c.placement.recompute_ranks.empty());  // not asked for
    if (k > 0) EXPECT_LE(ranking.others[k - 1].predicted_ms, c.predicted_ms);
  }
  // Without I and W on every stage nothing can be fitted: none, saying why.
  MeasuredCosts standard = split_costs(2);
  standard.backward_input.clear();
  const PlacementRanking none = rank_llama_placements(tiny(), current, standard, o);
  EXPECT_TRUE(none.others.empty());
  EXPECT_NE(none.why_none.find("F, I and W on every stage"), std::string::npos) << none.why_none;
}

// Two rank threads: a pipeline of the fixture's chunks per placement the search asks for, over the same transports.
struct Ranks {
  std::vector<std::unique_ptr<Transport>> transports = make_local_transports(2);
  std::vector<std::vector<std::unique_ptr<Pipeline>>> built{2};  // by rank, every pipeline built (kept alive)
  std::vector<std::vector<std::string>> rebuilt{2};              // by rank, the placements moved to

  Pipeline& build(int rank, const Placement& p) {
    std::vector<PipelineChunk> chunks;
    for (int s : p.schedule.stages_of(rank)) {
      std::shared_ptr<torch::nn::Module> m = make_chunk(s);
      chunks.push_back({s, m, [raw = m.get(), s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
    }
    built[rank].push_back(std::make_unique<Pipeline>(p.schedule, std::move(chunks), *transports[rank],
                                                     fixture_options()));
    return *built[rank].back();
  }
};

struct Outcome {
  std::vector<std::string> decisions;
  Placement running;
  std::string pipeline_schedule;
  int pipeline_stages = 0;
};

// Runs the search on both ranks from 1f1b 2BP (measured at `current_ms`) over `ranking`, every candidate's steps
// taking `ms[k][rank]` (warm-up steps 1000 ms).
std::vector<Outcome> search(Ranks& ranks, const PlacementRanking& ranking, double current_ms,
                            const std::vector<std::vector<double>>& ms) {
  const Placement start = placement("1f1b", 1, BackwardMode::kSplit);
  for (int r = 0; r < 2; ++r) ranks.build(r, start);
  std::vector<Outcome> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      PlacementSearchOptions o;
      o.steps = 3;
      o.candidates = 2;
      o.within = 1.0;
      o.timeout = std::chrono::seconds(30);
      PlacementSearch s(*ranks.built[r].front(), start, current_ms,
                        [&, r](const Placement& to) -> Pipeline& {
                          ranks.rebuilt[r].push_back(describe(to));
                          return ranks.build(r, to);
                        },
                        o);
      out[r].decisions.push_back(s.start(ranking));
      for (std::size_t k = 0; !s.done(); ++k) {
        for (int step = 0; step < o.steps && !s.done(); ++step) {
          StepResult result;
          result.pipeline_us = 1000.0 * (step == 0 ? 1000.0 : ms.at(k).at(r));
          if (auto news = s.after_step(result)) out[r].decisions.push_back(*news);
        }
      }
      out[r].running = s.running();
      out[r].pipeline_schedule = s.pipeline().schedule().name + " " + to_string(s.pipeline().schedule().backward);
      out[r].pipeline_stages = s.pipeline().schedule().num_stages;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(out[0].decisions, out[1].decisions);
  return out;
}

PlacementRanking two_candidates() {
  PlacementRanking ranking;
  ranking.current_ms = 10.0;
  ranking.fit = "by hand";
  ranking.others = {{placement("interleaved-1f1b", 2, BackwardMode::kSplit), 8.0},
                    {placement("interleaved-1f1b", 2, BackwardMode::kStandard), 9.0}};
  return ranking;
}

TEST(PlacementSearch, MovesToAnotherPlacementSwitchesItsFormsAndKeepsTheFastestMeasured) {
  Ranks ranks;
  // The first candidate 8 ms (slowest rank), its other form 5: kept, one move (the program's), one switch.
  const std::vector<Outcome> out = search(ranks, two_candidates(), 10.0, {{7.0, 8.0}, {5.0, 4.0}});
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    ASSERT_EQ(out[r].decisions.size(), 3u);
    EXPECT_NE(out[r].decisions[0].find("measuring the 2 of 2 forms of other placements"), std::string::npos);
    EXPECT_NE(out[r].decisions[1].find("measured 8.00 ms/step (predicted 8.00); switching to"), std::string::npos);
    EXPECT_NE(out[r].decisions[2].find("keeping interleaved-1f1b standard"), std::string::npos) << out[r].decisions[2];
    EXPECT_NE(out[r].decisions[2].find("5.00 ms/step measured against 10.00"), std::string::npos);
    EXPECT_EQ(ranks.rebuilt[r].size(), 1u);
    EXPECT_EQ(out[r].pipeline_schedule, "interleaved-1f1b standard");
    EXPECT_EQ(out[r].pipeline_stages, 4);
    EXPECT_EQ(out[r].running.schedule.backward, BackwardMode::kStandard);
  }
}

TEST(PlacementSearch, GoesBackWhenTheStartingFormMeasuresFastest) {
  Ranks ranks;
  const std::vector<Outcome> out = search(ranks, two_candidates(), 10.0, {{12.0, 11.0}, {11.0, 10.5}});
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    ASSERT_EQ(out[r].decisions.size(), 3u);
    EXPECT_NE(out[r].decisions[2].find("back to 1f1b 2bp"), std::string::npos) << out[r].decisions[2];
    EXPECT_NE(out[r].decisions[2].find("the fastest of 3 measured"), std::string::npos);
    EXPECT_EQ(ranks.rebuilt[r].size(), 2u);  // there and back
    EXPECT_EQ(out[r].pipeline_schedule, "1f1b 2bp");
    EXPECT_EQ(out[r].pipeline_stages, 2);
  }
}

TEST(PlacementSearch, KeepsTheRunningFormWhenNothingIsPredictedWithinReach) {
  Ranks ranks;
  PlacementRanking ranking = two_candidates();
  ranking.others.front().predicted_ms = ranking.others.back().predicted_ms = 30.0;  // beyond 2x the current 10
  const std::vector<Outcome> out = search(ranks, ranking, 10.0, {});
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(out[r].decisions.size(), 1u);
    EXPECT_NE(out[r].decisions[0].find("no other placement is predicted faster or within 100 %"), std::string::npos)
        << out[r].decisions[0];
    EXPECT_TRUE(ranks.rebuilt[r].empty());
    EXPECT_EQ(out[r].pipeline_stages, 2);
  }
}

TEST(PlacementSearch, RefusesOptionsOutOfRangeAndSwitchFormAnotherPlacement) {
  Ranks ranks;
  const Placement start = placement("1f1b", 1, BackwardMode::kSplit);
  Pipeline& p = ranks.build(0, start);
  PlacementSearchOptions o;
  o.steps = 1;
  auto rebuild = [&](const Placement&) -> Pipeline& { return p; };
  expect_error<UsageError>([&] { PlacementSearch(p, start, 1.0, rebuild, o); }, {"steps must be >= 2"});
  expect_error<UsageError>([&] { switch_form(p, placement("interleaved-1f1b", 2, BackwardMode::kSplit)); },
                           {"another placement", "PlacementSearch::Rebuild"});
}

// The whole run-time search on LLaMa chunks: AutoSchedule's probes and candidates, then the forms of other
// placements, the program's part (the move) rebuilding the rank's chunks; every rank decides alike.
TEST(LlamaAutoTuner, ChoosesAmongTheFormsThenMeasuresOtherPlacements) {
  constexpr int64_t kSeq = 16, kMicroBatchSize = 2;
  Placement start = placement("1f1b", 1, BackwardMode::kSplit);
  start.partition = models::make_partition(tiny(), 2, kSeq);  // as rank_llama_placements cuts them
  auto transports = make_local_transports(2);
  std::vector<std::vector<std::string>> decisions(2);
  std::vector<int> moves(2, 0);
  std::vector<std::string> ended(2);
  torch::manual_seed(5);
  const at::Tensor tokens = torch::randint(0, tiny().vocab_size, {4 * kMicroBatchSize, kSeq + 1}, at::kLong);
  run_rank_threads(transports, [&](Transport& t) {
    const int r = t.rank();
    std::vector<std::unique_ptr<Pipeline>> built;  // every pipeline this rank built, the running one last
    auto build = [&](const Placement& p) -> Pipeline& {
      models::LlamaRankOptions o{tiny(), p.partition, 7, kMicroBatchSize, kSeq};
      o.recompute = has_rank(p.recompute_ranks, r);
      PipelineOptions base;
      base.executor.timeout = std::chrono::seconds(60);
      built.push_back(models::build_llama_rank(p.schedule, t, o, base).pipeline);
      return *built.back();
    };
    LlamaAutoOptions o;
    o.schedule.probe_steps = o.schedule.verify_steps = 2;
    o.schedule.measure_candidates = 1;
    o.schedule.measure_within = 100;  // whatever the predictions, one candidate of each kind is measured
    o.schedule.timeout = std::chrono::seconds(60);
    o.placements = true;
    o.plan.micro_batch_size = kMicroBatchSize;
    o.plan.seq = kSeq;
    LlamaAutoTuner tuner(build(start), tiny(), start, o, [&](const Placement& to) -> Pipeline& {
      ++moves[r];
      return build(to);
    });
    for (int step = 0; step < 30 && !tuner.done(); ++step) {
      const Placement& running = tuner.running();
      const bool first = running.schedule.stage_to_rank.front() == r, last = running.schedule.stage_to_rank.back() == r;
      const models::LlamaRankBatch batch = models::llama_rank_batch(
          tokens.narrow(1, 0, kSeq), tokens.narrow(1, 1, kSeq), 0, 4 * kMicroBatchSize, kSeq, first, last, false, 0);
      const StepResult result = built.back()->step(batch.inputs, batch.targets);
      for (const std::string& news : tuner.after_step(result)) decisions[r].push_back(news);
    }
    EXPECT_TRUE(tuner.done());
    EXPECT_EQ(built.back()->schedule().name, tuner.running().schedule.name);
    EXPECT_EQ(built.back()->schedule().backward, tuner.running().schedule.backward);
    ended[r] = describe(tuner.running());
  }).rethrow_root_cause();
  EXPECT_EQ(decisions[0], decisions[1]);
  EXPECT_EQ(ended[0], ended[1]);
  EXPECT_EQ(moves[0], moves[1]);
  EXPECT_GE(moves[0], 1);  // to the other placement at least
  const auto said = [&](const std::string& words) {
    return std::any_of(decisions[0].begin(), decisions[0].end(),
                       [&](const std::string& d) { return d.find(words) != std::string::npos; });
  };
  EXPECT_TRUE(said("auto schedule:")) << ::testing::PrintToString(decisions[0]);
  EXPECT_TRUE(said("auto placement:")) << ::testing::PrintToString(decisions[0]);
  EXPECT_TRUE(said("moving to")) << ::testing::PrintToString(decisions[0]);
}

}  // namespace
}  // namespace twobp::testing
