// The schedule chosen at run time (twobp/plan/choose.h): the ranking is the simulator's under the measured costs,
// over exactly the schedules a running pipeline can switch to; AutoSchedule decides alike on every rank, switches
// at step boundaries, and the steps around its switches keep the single-process gradients (float64).

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/expect_error.h"
#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/metrics/memory.h"
#include "twobp/plan/choose.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/synthesize.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

MeasuredCosts split_costs(int stages, double f, double i, double w) {
  MeasuredCosts c;
  c.forward.assign(stages, f);
  c.backward_input.assign(stages, i);
  c.backward_weight.assign(stages, w);
  c.backward.assign(stages, 0.0);
  return c;
}

// Two rank threads' pipelines running `start` with `options`, stage r = make_chunk(r) on rank r.
struct TwoRanks {
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::vector<Transport*> transports;
};

TwoRanks two_rank_pipelines(const Schedule& start, const PipelineOptions& options) {
  TwoRanks out;
  auto transports = make_local_transports(2);
  for (int r = 0; r < 2; ++r) {
    out.modules.push_back(make_chunk(r));
    auto* raw = out.modules[r].get();
    std::vector<PipelineChunk> chunks;
    chunks.push_back({r, out.modules[r], [raw, r](const at::Tensor& x) { return run_chunk(*raw, r, x); }});
    out.pipelines.push_back(std::make_unique<Pipeline>(start, std::move(chunks),
                                                       std::shared_ptr<Transport>(std::move(transports[r])), options));
    out.transports.push_back(&out.pipelines[r]->transport());
  }
  return out;
}

// Without and with a fixed part of every W (MeasuredCosts::backward_weight_fixed, w0): a 2BP candidate's batched W
// costs w0 + k W, a standard candidate's fused B I + w0 + W.
TEST(RankSchedules, AreTheSimulatorsStepTimesOverTheSchedulesOfTheRunningPlacement) {
  for (const auto& [start, v, w0] : std::vector<std::tuple<std::string, int, double>>{
           {"1f1b", 1, 0.0}, {"interleaved-1f1b", 2, 0.0}, {"zb-v", 2, 0.0}, {"1f1b", 1, 0.5}, {"zb-v", 2, 0.5}}) {
    const Schedule running = make_schedule(start, ScheduleOptions{2, 4, v, BackwardMode::kSplit});
    MeasuredCosts costs = split_costs(running.num_stages, 1.0, 1.25, 0.75);
    costs.communication = 0.1;
    if (w0 > 0.0) costs.backward_weight_fixed.assign(running.num_stages, w0);
    const std::vector<ScheduleCandidate> ranking = rank_schedules(running, costs);
    ASSERT_GE(ranking.size(), 2u) << start;  // at least the running schedule's two forms
    bool has_running = false;
    for (std::size_t k = 0; k < ranking.size(); ++k) {
      const ScheduleCandidate& c = ranking[k];
      SCOPED_TRACE(start + " candidate " + c.name);
      EXPECT_EQ(c.schedule.stage_to_rank, running.stage_to_rank);
      EXPECT_EQ(c.schedule.num_micro_batches, running.num_micro_batches);
      EXPECT_EQ(c.schedule.backward, c.mode);
      if (k > 0) EXPECT_LE(ranking[k - 1].predicted_ms, c.predicted_ms);
      // The same prediction from the costs written out by hand: a fused B costs I + w0 + W.
      CostModel model = CostModel::uniform(running.num_stages, 1.0, 1.25, 0.75, 0.1);
      model.backward.assign(running.num_stages, 2.0 + w0);
      if (c.mode == BackwardMode::kSplit) model.backward_weight_fixed.assign(running.num_stages, w0);
      if (c.mode == BackwardMode::kStandard) {
        model.backward_input.assign(running.num_stages, 0.0);
        model.backward_weight.assign(running.num_stages, 0.0);
      }
      EXPECT_DOUBLE_EQ(c.predicted_ms, simulate(c.schedule, model).step_time);
      has_running = has_running || (c.name == start && c.mode == BackwardMode::kSplit);
    }
    EXPECT_TRUE(has_running) << start;
    // Every registered schedule of this placement is there, in both forms (none is rejected at p = 2, m = 4);
    // synth is synthesized on the running placement where it can take it.
    int expected = 0;
    const auto uniform = [](const std::vector<int>& owners) {
      return CostModel::uniform(static_cast<int>(owners.size()), 1.0, 1.25, 0.75, 0.1);
    };
    for (const std::string& name : schedule_names()) {
      for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
        try {
          const Schedule sc = make_schedule_for_costs(name, ScheduleOptions{2, 4, v, mode}, uniform,
                                                      SynthesisOptions::planning(), running.stage_to_rank);
          expected += sc.stage_to_rank == running.stage_to_rank;
        } catch (const UsageError&) {
        }
      }
    }
    EXPECT_EQ(static_cast<int>(ranking.size()), expected) << start;
  }
}

// Whether some W of `sc` runs several micro-batches at once.
bool batches_w(const Schedule& sc) {
  for (const auto& list : sc.actions) {
    for (const Action& a : list) {
      if (a.type == ActionType::kBackwardWeight && a.micro_batches.size() > 1) return true;
    }
  }
  return false;
}

// The fastest predicted 2BP form that batches W and the fastest that does not (ranked fastest first).
std::pair<const ScheduleCandidate*, const ScheduleCandidate*> best_batching_and_not(
    const std::vector<ScheduleCandidate>& ranking) {
  const ScheduleCandidate *batching = nullptr, *one_by_one = nullptr;
  for (const ScheduleCandidate& c : ranking) {
    const ScheduleCandidate*& slot = batches_w(c.schedule) ? batching : one_by_one;
    if (slot == nullptr) slot = &c;
  }
  return {batching, one_by_one};
}

// The same W of one micro-batch (1 ms), without and with most of it fixed: when W is proportional to its size, no
// form that batches W is predicted faster than the best that runs W's one by one (batching only delays the same
// work); when batching makes W nearly free per micro-batch, the best form batches W, strictly ahead.
TEST(RankSchedules, AFixedWPartFavoursFormsThatBatchW) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{2, 8, 1, BackwardMode::kSplit});
  RankOptions split_only;
  split_only.modes = {BackwardMode::kSplit};
  const auto proportional = rank_schedules(running, split_costs(2, 1.0, 1.0, 1.0), split_only);
  MeasuredCosts mostly_fixed = split_costs(2, 1.0, 1.0, 0.1);
  mostly_fixed.backward_weight_fixed = {0.9, 0.9};
  const auto fixed = rank_schedules(running, mostly_fixed, split_only);
  const auto [p_batching, p_one_by_one] = best_batching_and_not(proportional);
  const auto [f_batching, f_one_by_one] = best_batching_and_not(fixed);
  ASSERT_TRUE(p_batching && p_one_by_one && f_batching && f_one_by_one);
  EXPECT_LE(p_one_by_one->predicted_ms, p_batching->predicted_ms) << p_one_by_one->name << " " << p_batching->name;
  EXPECT_LT(f_batching->predicted_ms, f_one_by_one->predicted_ms) << f_batching->name << " " << f_one_by_one->name;
  EXPECT_EQ(&fixed.front(), f_batching);
  // W's one by one cost the same under both (0.9 + 0.1 = 1 per W): only the batching forms got faster.
  EXPECT_DOUBLE_EQ(f_one_by_one->predicted_ms, p_one_by_one->predicted_ms);
}

TEST(RankSchedules, CostsOfAStandardRunRankOnlyStandardFormsAndNamesFilter) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kStandard});
  MeasuredCosts costs = split_costs(2, 1.0, 0.0, 0.0);
  costs.backward = {2.0, 2.0};
  const auto ranking = rank_schedules(running, costs);
  ASSERT_FALSE(ranking.empty());
  for (const auto& c : ranking) EXPECT_EQ(c.mode, BackwardMode::kStandard) << c.name;
  RankOptions zb;
  zb.names = {"zb-h1"};
  zb.modes = {BackwardMode::kSplit};
  const auto only = rank_schedules(running, split_costs(2, 1.0, 1.0, 1.0), zb);
  ASSERT_EQ(only.size(), 1u);
  EXPECT_EQ(only[0].name, "zb-h1");
  EXPECT_THROW(rank_schedules(running, split_costs(3, 1.0, 1.0, 1.0)), UsageError);  // costs of other stages
}

// The candidate sets that would leave nothing to rank are refused, naming the culprit: every unregistered name (a
// typo, another case, one beside valid names) and the empty set of modes -- never "no candidate predicted faster".
std::vector<RankOptions> unusable_candidate_sets() {
  std::vector<RankOptions> sets;
  for (std::vector<std::string> names : {std::vector<std::string>{"1f1bb"}, std::vector<std::string>{"ZB-H1"},
                                         std::vector<std::string>{"zb-h1", "no-such-schedule"},
                                         std::vector<std::string>{""}}) {
    RankOptions o;
    o.names = std::move(names);
    sets.push_back(o);
  }
  RankOptions no_modes;
  no_modes.modes.clear();
  sets.push_back(no_modes);
  RankOptions no_modes_named = no_modes;
  no_modes_named.names = {"1f1b"};
  sets.push_back(no_modes_named);
  return sets;
}

// The word each refusal must contain: the unknown name, else "modes".
std::string culprit(const RankOptions& o) {
  if (o.modes.empty()) return "modes";
  for (const std::string& n : o.names) {
    if (n != "zb-h1") return fmt::format("'{}'", n);
  }
  return "?";
}

TEST(RankSchedules, UnknownNamesAndNoModesAreRefused) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  for (const RankOptions& o : unusable_candidate_sets()) {
    expect_error([&] { rank_schedules(running, split_costs(2, 1.0, 1.0, 1.0), o); }, {"rank_schedules", culprit(o)});
  }
}

// Issue 69: exact ties are in registry order, standard before 2BP, whatever order RankOptions gives the names and
// modes in (choose.h); and costs that are not costs are refused where they enter, naming the list and stage.
TEST(RankSchedules, TiesFollowTheRegistryNotTheCallersOrder) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  MeasuredCosts costs = split_costs(2, 1.0, 1.0, 1.0);
  costs.backward = {2.0, 2.0};
  RankOptions given;
  given.names = schedule_names();
  std::reverse(given.names.begin(), given.names.end());
  given.modes = {BackwardMode::kSplit, BackwardMode::kStandard};
  const auto mine = rank_schedules(running, costs, given);
  const auto registry = rank_schedules(running, costs);
  ASSERT_EQ(mine.size(), registry.size());
  const std::vector<std::string> names = schedule_names();
  auto index = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  int ties = 0;
  for (std::size_t k = 0; k < mine.size(); ++k) {
    EXPECT_EQ(mine[k].name, registry[k].name) << k;
    EXPECT_EQ(mine[k].mode, registry[k].mode) << k;
    if (k > 0 && mine[k].predicted_ms == mine[k - 1].predicted_ms) {
      ++ties;
      const auto& a = mine[k - 1];
      const auto& b = mine[k];
      EXPECT_TRUE(index(a.name) < index(b.name) ||
                  (a.name == b.name && a.mode == BackwardMode::kStandard && b.mode == BackwardMode::kSplit))
          << a.name << " " << to_string(a.mode) << " before " << b.name << " " << to_string(b.mode);
    }
  }
  EXPECT_GT(ties, 0) << "the costs should make some candidates tie (gpipe and 1f1b standard)";
}

TEST(RankSchedules, RefusesCostsThatAreNotCosts) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {std::nan(""), inf, -inf, -1.0, 1e308}) {
    MeasuredCosts costs = split_costs(2, 1.0, 1.0, 1.0);
    costs.backward_input[1] = bad;
    expect_error([&] { rank_schedules(running, costs); }, {"rank_schedules: costs: costs_ms.I[1] is "});
    RankOptions o;
    MeasuredCosts recomputing = split_costs(2, 1.0, 1.0, 1.0);
    recomputing.forward[0] = bad;
    o.recompute_costs = &recomputing;
    expect_error([&] { rank_schedules(running, split_costs(2, 1.0, 1.0, 1.0), o); },
                 {"rank_schedules: RankOptions.recompute_costs: costs_ms.F[0] is "});
  }
  RankOptions nan_limit;
  nan_limit.memory_limit_bytes = std::nan("");
  expect_error([&] { rank_schedules(running, split_costs(2, 1.0, 1.0, 1.0), nan_limit); },
               {"memory_limit_bytes is nan"});
}

// A memory model whose numbers differ per stage and action type: F keeps activations, I frees most, W the rest.
MemoryModel made_up_memory(int ranks, int stages) {
  MemoryModel m;
  m.base.assign(ranks, 1000.0);
  m.stages.resize(stages);
  m.gradients.assign(stages, 50.0);
  for (int s = 0; s < stages; ++s) {
    auto& a = m.stages[s];
    a[static_cast<int>(ActionType::kForward)] = {100.0 + 10 * s, 120.0 + 10 * s};
    a[static_cast<int>(ActionType::kBackwardInput)] = {-70.0 - 7 * s, 30.0};
    a[static_cast<int>(ActionType::kBackwardWeight)] = {-30.0 - 3 * s, 5.0};
    a[static_cast<int>(ActionType::kBackward)] = {-100.0 - 10 * s, 40.0};
  }
  return m;
}

TEST(RankSchedules, AMemoryLimitKeepsTheCandidatesWhosePredictedPeakFits) {
  const Schedule running = make_schedule("1f1b", ScheduleOptions{4, 8, 1, BackwardMode::kSplit});
  const MeasuredCosts costs = split_costs(4, 1.0, 1.0, 1.0);
  const MemoryModel memory = made_up_memory(4, 4);
  RankOptions with_memory;
  with_memory.memory = &memory;
  const std::vector<ScheduleCandidate> all = rank_schedules(running, costs, with_memory);
  ASSERT_GE(all.size(), 3u);
  std::vector<double> peaks;
  for (const ScheduleCandidate& c : all) {
    const std::vector<double> per_rank = simulate_peak_memory(c.schedule, memory);
    EXPECT_DOUBLE_EQ(c.predicted_peak_bytes, *std::max_element(per_rank.begin(), per_rank.end())) << c.name;
    peaks.push_back(c.predicted_peak_bytes);
  }
  std::sort(peaks.begin(), peaks.end());
  ASSERT_LT(peaks.front(), peaks.back()) << "the made-up model should tell schedules apart (gpipe keeps more)";
  RankOptions limited = with_memory;
  limited.memory_limit_bytes = peaks[peaks.size() / 2];
  const std::vector<ScheduleCandidate> kept = rank_schedules(running, costs, limited);
  std::size_t fitting = 0;
  for (const ScheduleCandidate& c : all) fitting += c.predicted_peak_bytes <= limited.memory_limit_bytes;
  EXPECT_EQ(kept.size(), fitting);
  for (const ScheduleCandidate& c : kept) EXPECT_LE(c.predicted_peak_bytes, limited.memory_limit_bytes) << c.name;
  RankOptions no_model;
  no_model.memory_limit_bytes = 1e9;  // a limit without the model that would check it
  EXPECT_THROW(rank_schedules(running, costs, no_model), UsageError);
  const MemoryModel other = made_up_memory(2, 2);  // another placement's model
  RankOptions wrong;
  wrong.memory = &other;
  EXPECT_THROW(rank_schedules(running, costs, wrong), UsageError);
}

// RankOptions::recompute_costs / recompute_memory: every form once with no rank recomputing and once with the
// first j = 1 .. p ranks of recompute_order by its peaks recomputing, each predicted from per-stage costs and
// memory taken from the recomputing measurement exactly where the stage's rank is among recompute_ranks (written
// out here stage by stage), on placements of one and two stages per rank. A limit that 1F1B standard only fits
// with some ranks recomputing keeps those settings of it and not the others.
TEST(RankSchedules, RecomputingRanksTakeEachStagesCostsAndMemoryFromItsRanksSetting) {
  for (const auto& [start, p, v] :
       std::vector<std::tuple<std::string, int, int>>{{"1f1b", 2, 1}, {"1f1b", 4, 1}, {"zb-v", 2, 2}}) {
    SCOPED_TRACE(start + " p=" + std::to_string(p));
    const Schedule running = make_schedule(start, ScheduleOptions{p, 2 * p, v, BackwardMode::kSplit});
    const int S = running.num_stages;
    MeasuredCosts built = split_costs(S, 1.0, 1.25, 0.75), recomputing = split_costs(S, 0.875, 1.25, 0.75);
    built.backward.assign(S, 1.75);
    recomputing.backward.assign(S, 1.75);
    recomputing.recompute.assign(S, 0.875);
    recomputing.backward_weight_fixed.assign(S, 0.125);
    const MemoryModel built_memory = made_up_memory(p, S);
    MemoryModel recomputing_memory = made_up_memory(p, S);
    for (int st = 0; st < S; ++st) {  // F keeps only the stage's input; I and B free that much less
      recomputing_memory.stages[st][static_cast<int>(ActionType::kForward)] = {20.0, 120.0 + 10 * st};
      recomputing_memory.stages[st][static_cast<int>(ActionType::kBackwardInput)] = {-20.0 + 30.0 + 3 * st, 130.0};
      recomputing_memory.stages[st][static_cast<int>(ActionType::kBackward)] = {-20.0, 140.0};
    }
    recomputing_memory.base.assign(p, 990.0);
    RankOptions ro;
    ro.memory = &built_memory;
    ro.recompute_costs = &recomputing;
    EXPECT_THROW(rank_schedules(running, built, ro), UsageError);  // recomputing costs without their memory
    ro.recompute_memory = &recomputing_memory;
    const std::vector<ScheduleCandidate> ranking = rank_schedules(running, built, ro);
    RankOptions as_built;
    as_built.memory = &built_memory;
    EXPECT_EQ(ranking.size(), (p + 1) * rank_schedules(running, built, as_built).size());
    std::vector<int> settings_seen(p + 1, 0);
    for (const ScheduleCandidate& c : ranking) {
      SCOPED_TRACE(c.name + (c.mode == BackwardMode::kSplit ? " 2bp" : " standard") + " recompute_ranks " +
                   format_ranks(c.recompute_ranks));
      const int j = static_cast<int>(c.recompute_ranks.size());
      ASSERT_LE(j, p);
      ++settings_seen[j];
      const std::vector<double> peaks_without = simulate_peak_memory(c.schedule, built_memory);
      EXPECT_EQ(c.recompute_ranks, first_ranks_of(recompute_order(peaks_without, p), j));
      MeasuredCosts mixed = built;
      mixed.recompute.assign(S, 0.0);
      mixed.backward_weight_fixed.assign(S, 0.0);
      MemoryModel memory = built_memory;
      for (int st = 0; st < S; ++st) {
        if (std::find(c.recompute_ranks.begin(), c.recompute_ranks.end(), running.stage_to_rank[st]) ==
            c.recompute_ranks.end()) {
          continue;
        }
        mixed.forward[st] = recomputing.forward[st];
        mixed.recompute[st] = recomputing.recompute[st];
        mixed.backward_weight_fixed[st] = recomputing.backward_weight_fixed[st];
        memory.stages[st] = recomputing_memory.stages[st];
      }
      for (int r : c.recompute_ranks) memory.base[r] = recomputing_memory.base[r];
      if (j == 0) mixed.recompute.clear();
      if (j == 0) mixed.backward_weight_fixed.clear();
      EXPECT_DOUBLE_EQ(c.predicted_ms, simulate(c.schedule, mixed.cost_model(c.mode)).step_time);
      const std::vector<double> peaks = simulate_peak_memory(c.schedule, memory);
      EXPECT_DOUBLE_EQ(c.predicted_peak_bytes, *std::max_element(peaks.begin(), peaks.end()));
    }
    for (int j = 0; j <= p; ++j) EXPECT_GT(settings_seen[j], 0) << j;
    RankOptions wrong = ro;
    const MemoryModel other_placement = made_up_memory(p + 1, S + 1);
    wrong.recompute_memory = &other_placement;
    EXPECT_THROW(rank_schedules(running, built, wrong), UsageError);
    MeasuredCosts short_list = recomputing;
    short_list.recompute.pop_back();
    wrong = ro;
    wrong.recompute_costs = &short_list;
    EXPECT_THROW(rank_schedules(running, built, wrong), UsageError);

    // The limit: 1F1B standard with only rank 0 recomputing.
    if (start != "1f1b") continue;
    double limit = 0.0, none = 0.0, all = 0.0;
    for (const ScheduleCandidate& c : ranking) {
      if (c.name != "1f1b" || c.mode != BackwardMode::kStandard) continue;
      if (c.recompute_ranks == std::vector<int>{0}) limit = c.predicted_peak_bytes;
      if (c.recompute_ranks.empty()) none = c.predicted_peak_bytes;
      if (static_cast<int>(c.recompute_ranks.size()) == p) all = c.predicted_peak_bytes;
    }
    ASSERT_GT(limit, 0.0);   // rank 0 holds the most activations in 1F1B: it recomputes first
    ASSERT_LT(limit, none);
    ASSERT_LE(all, limit);
    ro.memory_limit_bytes = limit;
    std::vector<std::vector<int>> kept;
    for (const ScheduleCandidate& c : rank_schedules(running, built, ro)) {
      EXPECT_LE(c.predicted_peak_bytes, limit);
      if (c.name == "1f1b" && c.mode == BackwardMode::kStandard) kept.push_back(c.recompute_ranks);
    }
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.size() < b.size(); });
    ASSERT_FALSE(kept.empty());
    EXPECT_EQ(kept.front(), std::vector<int>{0});
  }
}

// Recomputation goes where the memory is: under a memory limit, each form's fitting candidate with the fewest
// recomputing ranks recomputes on exactly the ranks whose peak without recomputation is over the limit (a rank's
// peak depends on its own actions alone), wherever those ranks are: the first of a 1F1B-like order, the last of a
// GPipe-like order whose last stage keeps the most (a large vocabulary's logits). p = 4, m = 8.
TEST(RankSchedules, RecomputationGoesToTheRanksOverTheLimit) {
  const int p = 4;
  const Schedule running = make_schedule("1f1b", ScheduleOptions{p, 2 * p, 1, BackwardMode::kSplit});
  const MeasuredCosts built = split_costs(p, 1.0, 1.25, 0.75);
  MeasuredCosts recomputing = split_costs(p, 1.0, 1.25, 0.75);
  recomputing.recompute.assign(p, 1.0);
  auto at = [](MemoryModel& m, int stage, ActionType type) -> auto& { return m.stages[stage][static_cast<int>(type)]; };
  MemoryModel built_memory = made_up_memory(p, p);
  at(built_memory, p - 1, ActionType::kForward) = {480.0, 500.0};  // the head's logits: 4x the others' activations
  at(built_memory, p - 1, ActionType::kBackwardInput) = {-420.0, 30.0};
  at(built_memory, p - 1, ActionType::kBackwardWeight) = {-60.0, 5.0};
  at(built_memory, p - 1, ActionType::kBackward) = {-480.0, 40.0};
  MemoryModel recomputing_memory = made_up_memory(p, p);
  for (int st = 0; st < p; ++st) {  // F keeps only the stage's input; I and B rise to the activations first
    const double act = st == p - 1 ? 480.0 : 100.0 + 10 * st;
    at(recomputing_memory, st, ActionType::kForward) = {20.0, act};
    at(recomputing_memory, st, ActionType::kBackwardInput) = {-20.0 + 30.0 + 3 * st, act};
    at(recomputing_memory, st, ActionType::kBackwardWeight) = {-30.0 - 3 * st, 5.0};
    at(recomputing_memory, st, ActionType::kBackward) = {-20.0, act};
  }
  RankOptions ro;
  ro.memory = &built_memory;
  ro.recompute_costs = &recomputing;
  ro.recompute_memory = &recomputing_memory;
  // The limit: just under GPipe standard's last rank, over its other ranks.
  const Schedule gpipe = make_schedule("gpipe", ScheduleOptions{p, 2 * p, 1, BackwardMode::kStandard});
  std::vector<double> gpipe_peaks = simulate_peak_memory(gpipe, built_memory);
  ASSERT_EQ(std::max_element(gpipe_peaks.begin(), gpipe_peaks.end()) - gpipe_peaks.begin(), p - 1);
  std::vector<double> sorted = gpipe_peaks;
  std::sort(sorted.begin(), sorted.end());
  ro.memory_limit_bytes = (sorted[p - 1] + sorted[p - 2]) / 2;
  // Per form, the fitting candidate with the fewest recomputing ranks.
  std::map<std::pair<std::string, BackwardMode>, const ScheduleCandidate*> fewest;
  const std::vector<ScheduleCandidate> ranking = rank_schedules(running, built, ro);
  for (const ScheduleCandidate& c : ranking) {
    EXPECT_LE(c.predicted_peak_bytes, ro.memory_limit_bytes) << c.name;
    const ScheduleCandidate*& f = fewest[{c.name, c.mode}];
    if (f == nullptr || c.recompute_ranks.size() < f->recompute_ranks.size()) f = &c;
  }
  for (const auto& [form, c] : fewest) {
    SCOPED_TRACE(form.first + (form.second == BackwardMode::kSplit ? " 2bp" : " standard"));
    std::vector<int> over;
    const std::vector<double> peaks = simulate_peak_memory(c->schedule, built_memory);
    for (int r = 0; r < p; ++r) {
      if (peaks[r] > ro.memory_limit_bytes) over.push_back(r);
    }
    EXPECT_EQ(format_ranks(c->recompute_ranks), format_ranks(over));
  }
  const auto gpipe_kept = fewest.find({"gpipe", BackwardMode::kStandard});
  ASSERT_NE(gpipe_kept, fewest.end()) << "GPipe fits with its last rank recomputing";
  EXPECT_EQ(gpipe_kept->second->recompute_ranks, std::vector<int>{p - 1});
}

// AutoSchedule on 2 rank threads: whatever the machine's timings make it choose, every rank prints the same
// decisions at the same steps, the pipeline runs the announced schedule after each, and every step's gradients
// (no optimizer: the weights stay) are the single-process ones.
TEST(AutoSchedule, DecidesAlikeOnEveryRankAndKeepsTheGradients) {
  Float64Default float64;
  constexpr int kProbe = 3, kVerify = 3, kCandidates = 3, kMicroBatches = 4;
  constexpr int kProbes = 2;  // gpipe 2BP, then gpipe standard
  constexpr int kSteps = kProbes * kProbe + kCandidates * kVerify + 1;  // one step after the last decision
  const Schedule start = make_schedule("gpipe", ScheduleOptions{2, kMicroBatches, 1, BackwardMode::kSplit});
  torch::manual_seed(1);
  const auto inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const auto targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const Reference ref = run_reference(2, kMicroBatches, inputs, targets);
  TwoRanks ranks = two_rank_pipelines(start, fixture_options());
  auto& pipelines = ranks.pipelines;
  auto& modules = ranks.modules;
  std::vector<std::vector<std::pair<int, std::string>>> news(2);     // (step, line) per rank
  std::vector<std::vector<std::string>> schedule_at(2);              // schedule name after each step
  std::vector<std::vector<std::string>> mismatches(2);
  std::vector<std::vector<double>> trial_ms(2);
  std::vector<double> start_ms(2), chosen_ms(2);
  std::vector<std::vector<double>> probe_ms(2);
  std::mutex mutex;
  run_rank_threads(ranks.transports, [&](Transport& t) {
    const int r = t.rank();
    Pipeline& pipeline = *pipelines[r];
    AutoScheduleOptions o;
    o.probe_steps = kProbe;
    o.verify_steps = kVerify;
    o.measure_candidates = kCandidates;
    o.measure_within = 10.0;  // every candidate up to 11x the best prediction: the trials happen whatever the timings
    AutoSchedule chooser(pipeline, o);
    for (int step = 0; step < kSteps; ++step) {
      pipeline.zero_grad();
      const StepResult result = pipeline.step(inputs, targets);
      std::string bad;
      for (const auto& item : ref.chunks[r]->named_parameters()) {
        const at::Tensor g = modules[r]->named_parameters()[item.key()].grad();
        if (!g.defined() || (g - item.value().grad()).abs().max().item<double>() > 1e-12) {
          bad = "step " + std::to_string(step) + " " + item.key();
        }
      }
      std::optional<std::string> line = chooser.after_step(result);
      std::lock_guard<std::mutex> lock(mutex);
      if (!bad.empty()) mismatches[r].push_back(bad);
      if (line) news[r].emplace_back(step, *line);
      schedule_at[r].push_back(pipeline.schedule().name + (pipeline.schedule().backward == BackwardMode::kSplit
                                                               ? " 2bp"
                                                               : " standard"));
    }
    EXPECT_EQ(chooser.phase(), AutoSchedule::Phase::kDone);
    std::lock_guard<std::mutex> lock(mutex);
    trial_ms[r] = chooser.trial_ms();
    probe_ms[r] = chooser.probe_ms();
    start_ms[r] = chooser.starting_ms();
    chosen_ms[r] = chooser.chosen_ms();
  }).rethrow_root_cause();
  EXPECT_TRUE(mismatches[0].empty() && mismatches[1].empty())
      << (mismatches[0].empty() ? mismatches[1].front() : mismatches[0].front());
  EXPECT_EQ(news[0], news[1]);
  EXPECT_EQ(schedule_at[0], schedule_at[1]);
  EXPECT_EQ(trial_ms[0], trial_ms[1]);
  EXPECT_EQ(start_ms[0], start_ms[1]);
  // The probe of gpipe 2BP ends at step kProbe - 1 and switches to gpipe standard (the fused B's cost); that one
  // ends kProbe steps later with a shortlist of kCandidates (a generous measure_within keeps that many of the
  // 2-rank placement's candidates); each trial ends kVerify steps after the previous decision, the last one
  // settling on the fastest measured of all. The schedule changes only at those steps.
  ASSERT_EQ(news[0].size(), static_cast<std::size_t>(kProbes + kCandidates));
  ASSERT_EQ(trial_ms[0].size(), static_cast<std::size_t>(kCandidates));
  ASSERT_EQ(probe_ms[0].size(), static_cast<std::size_t>(kProbes));
  EXPECT_EQ(probe_ms[0], probe_ms[1]);
  for (int k = 0; k < kProbes + kCandidates; ++k) {
    const int at = k < kProbes ? (k + 1) * kProbe - 1 : kProbes * kProbe - 1 + (k - kProbes + 1) * kVerify;
    EXPECT_EQ(news[0][k].first, at) << news[0][k].second;
  }
  EXPECT_NE(news[0][0].second.find("measuring its standard form too"), std::string::npos) << news[0][0].second;
  EXPECT_EQ(schedule_at[0][kProbe - 1], "gpipe standard");
  EXPECT_NE(news[0][1].second.find("measuring the 3 of"), std::string::npos) << news[0][1].second;
  for (int step = 0; step < kProbe - 1; ++step) EXPECT_EQ(schedule_at[0][step], "gpipe 2bp");
  for (int step = 1; step < kSteps; ++step) {  // schedule_at[step]: the schedule after step's decision, if any
    bool decided = false;
    for (const auto& [at, line] : news[0]) decided = decided || at == step;
    if (!decided) EXPECT_EQ(schedule_at[0][step], schedule_at[0][step - 1]) << "changed at step " << step;
  }
  std::vector<double> all = probe_ms[0];
  all.insert(all.end(), trial_ms[0].begin(), trial_ms[0].end());
  const double fastest = *std::min_element(all.begin(), all.end());
  EXPECT_EQ(chosen_ms[0], fastest);
  EXPECT_EQ(start_ms[0], probe_ms[0][0]);
  const bool back = news[0].back().second.find("back to gpipe 2bp") != std::string::npos;
  EXPECT_EQ(back, fastest == probe_ms[0][0]) << news[0].back().second;
  EXPECT_EQ(schedule_at[0].back() == "gpipe 2bp", back) << news[0].back().second;
}

// With a memory limit the candidates are ranked with their predicted peak from the probe's measured memory model,
// alike on every rank; a limit nothing fits keeps the starting schedule.
TEST(AutoSchedule, AMemoryLimitRanksOnlyCandidatesThatFit) {
  Float64Default float64;
  memory::count_cpu_allocations();  // tensor memory per rank account (twobp/metrics/memory.h)
  constexpr int kMicroBatches = 4;
  const Schedule start = make_schedule("gpipe", ScheduleOptions{2, kMicroBatches, 1, BackwardMode::kSplit});
  torch::manual_seed(1);
  const auto inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const auto targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  for (const double limit : {1.0, 1e15}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    PipelineOptions po = fixture_options();
    po.executor.record_memory = true;
    TwoRanks ranks = two_rank_pipelines(start, po);
    auto& pipelines = ranks.pipelines;
    std::vector<std::vector<ScheduleCandidate>> rankings(2);
    std::vector<std::string> first_news(2);  // the last decision of the 4 steps
    std::vector<MeasuredCosts> measured(2);  // measured_costs() after the probe
    std::vector<int> measured_before(2, -1);  // its stages before the probe ended
    run_rank_threads(ranks.transports, [&](Transport& t) {
      const int r = t.rank();
      AutoScheduleOptions o;
      o.probe_steps = 2;
      o.verify_steps = 2;
      o.memory_limit_bytes = limit;
      AutoSchedule chooser(*pipelines[r], o);
      for (int step = 0; step < 4; ++step) {  // both forms of gpipe probed: the ranking exists
        if (step == 3) measured_before[r] = chooser.measured_costs().num_stages();
        pipelines[r]->zero_grad();
        std::optional<std::string> line = chooser.after_step(pipelines[r]->step(inputs, targets));
        if (line) first_news[r] = *line;
      }
      rankings[r] = chooser.ranking();
      measured[r] = chooser.measured_costs();
    }).rethrow_root_cause();
    // The costs the ranking came from, as built and agreed: every stage's F, I and W (2BP probe) and B (standard).
    EXPECT_EQ(measured_before[0], 0);
    const MeasuredCosts& m = measured[0];
    for (const std::vector<double>& ms : {m.forward, m.backward_input, m.backward_weight, m.backward}) {
      ASSERT_EQ(ms.size(), 2u);
      for (double x : ms) EXPECT_GT(x, 0.0);
    }
    EXPECT_EQ(measured[1].forward, m.forward);  // every rank holds the same numbers
    EXPECT_EQ(measured[1].backward_input, m.backward_input);
    EXPECT_EQ(measured[1].backward_weight, m.backward_weight);
    EXPECT_EQ(measured[1].backward, m.backward);
    EXPECT_EQ(first_news[0], first_news[1]);
    ASSERT_EQ(rankings[0].size(), rankings[1].size());
    if (limit < 2.0) {  // nothing fits in one byte: back to the starting schedule, not its measured other form
      EXPECT_TRUE(rankings[0].empty());
      EXPECT_NE(first_news[0].find("back to gpipe 2bp"), std::string::npos) << first_news[0];
      EXPECT_NE(first_news[0].find("within"), std::string::npos) << first_news[0];
      for (const auto& p : pipelines) EXPECT_EQ(p->schedule().name, "gpipe");
      continue;
    }
    ASSERT_FALSE(rankings[0].empty());
    for (std::size_t k = 0; k < rankings[0].size(); ++k) {
      EXPECT_GT(rankings[0][k].predicted_peak_bytes, 0.0) << rankings[0][k].name;
      EXPECT_EQ(rankings[0][k].predicted_peak_bytes, rankings[1][k].predicted_peak_bytes) << rankings[0][k].name;
    }
  }
}

// What one rank saw of an AutoSchedule run (RunRecomputingAuto).
struct Seen {
  std::vector<std::pair<int, std::string>> news;
  std::vector<std::string> problems;
  std::vector<bool> recomputing;     // this rank, after each step's decision
  std::vector<std::vector<int>> recompute_ranks;  // after each step's decision
  std::vector<ScheduleCandidate> ranking, probes;
  bool done = false;
  bool recomputing_at_end = false;
};

// 1f1b standard on 2 rank threads for `steps` steps under AutoSchedule with recompute, probe and verify steps of 2,
// `names` as candidates and `limit` on their memory. Checks on every step that the gradients are the
// single-process ones, that each rank's stage recomputes exactly when the chooser says this rank does (it is in
// recompute_ranks(): one rank alone for the candidates with one recomputing rank) and that the trace's I's and B's
// re-run forwards exactly then.
std::vector<Seen> run_recomputing_auto(int steps, std::vector<std::string> names, int candidates, double limit) {
  constexpr int kMicroBatches = 4;
  const Schedule start = make_schedule("1f1b", ScheduleOptions{2, kMicroBatches, 1, BackwardMode::kStandard});
  torch::manual_seed(3);
  const auto inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const auto targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const Reference ref = run_reference(2, kMicroBatches, inputs, targets);
  PipelineOptions po = fixture_options();
  po.executor.record_memory = true;
  TwoRanks ranks = two_rank_pipelines(start, po);
  auto& pipelines = ranks.pipelines;
  auto& modules = ranks.modules;
  std::vector<Seen> seen(2);
  run_rank_threads(ranks.transports, [&](Transport& t) {
    const int r = t.rank();
    Pipeline& pipeline = *pipelines[r];
    Seen& mine = seen[r];
    AutoScheduleOptions o;
    o.probe_steps = 2;
    o.verify_steps = 2;
    o.measure_candidates = candidates;
    o.measure_within = 10.0;  // the trials happen whatever the timings
    o.memory_limit_bytes = limit;
    o.recompute = true;
    o.names = names;
    AutoSchedule chooser(pipeline, o);
    bool recomputing = false;  // what the step about to run does
    for (int step = 0; step < steps; ++step) {
      pipeline.zero_grad();
      const StepResult result = pipeline.step(inputs, targets);
      for (const auto& item : ref.chunks[r]->named_parameters()) {
        const at::Tensor g = modules[r]->named_parameters()[item.key()].grad();
        if (!g.defined() || (g - item.value().grad()).abs().max().item<double>() > 1e-12) {
          mine.problems.push_back("step " + std::to_string(step) + " " + item.key());
        }
      }
      for (const TraceEvent& e : result.trace.events) {
        const bool backward = e.action.type == ActionType::kBackward || e.action.type == ActionType::kBackwardInput;
        if (backward && (e.recompute_us > 0.0) != recomputing) {
          mine.problems.push_back(fmt::format("step {}: {} recompute_us {} while recomputing is {}", step,
                                              describe(e.action), e.recompute_us, recomputing));
        }
      }
      if (std::optional<std::string> line = chooser.after_step(result)) mine.news.emplace_back(step, *line);
      recomputing = chooser.recomputing();
      if (recomputing != has_rank(chooser.recompute_ranks(), r)) {
        mine.problems.push_back("step " + std::to_string(step) + ": recomputing() is not rank in recompute_ranks()");
      }
      mine.recomputing.push_back(recomputing);
      mine.recompute_ranks.push_back(chooser.recompute_ranks());
      if (pipeline.stage(r).options().recompute != recomputing) {
        mine.problems.push_back("step " + std::to_string(step) + ": the stage's recompute is not the chooser's");
      }
    }
    mine.done = chooser.phase() == AutoSchedule::Phase::kDone;
    mine.ranking = chooser.ranking();
    mine.probes = chooser.probes();
    mine.recomputing_at_end = pipeline.stage(r).options().recompute;
  }).rethrow_root_cause();
  for (const Seen& s : seen) {
    EXPECT_TRUE(s.problems.empty()) << s.problems.front();
    EXPECT_TRUE(s.done);
  }
  EXPECT_EQ(seen[0].news, seen[1].news);
  EXPECT_EQ(seen[0].recompute_ranks, seen[1].recompute_ranks);
  return seen;
}

// AutoScheduleOptions::recompute: the starting schedule's two forms are probed again with every stage recomputing,
// on costs and a memory model of their own (F keeps only its inputs: recomputing forms predict less memory in
// standard mode, where the activations are the peak, and about as much in 2BP); the ranking holds every form with
// no rank, one rank (the one the form's predicted peak is highest on) and both recomputing; each rank's stages
// recompute exactly while a form that covers the rank runs, and every step keeps the single-process gradients --
// with one rank recomputing and the other not, too. A memory limit that only recomputing forms fit moves the job off
// its starting schedule onto one of them.
TEST(AutoSchedule, RecomputingFormsAreProbedRankedAndKeepTheGradients) {
  Float64Default float64;
  memory::count_cpu_allocations();
  // Candidates 1f1b and gpipe, 2 forms x 3 recompute settings each: 1f1b's forms with 0 and 2 recomputing ranks are
  // the four probes, the other eight candidates the trials.
  constexpr int kProbe = 2, kVerify = 2, kCandidates = 8, kProbes = 4;
  const std::vector<Seen> seen =
      run_recomputing_auto(kProbes * kProbe + kCandidates * kVerify + 1, {"1f1b", "gpipe"}, kCandidates, 1e15);
  // 1f1b standard, 1f1b 2BP, then both with every stage recomputing: the third probe starts at step 2 kProbe.
  const Seen& s = seen[0];
  ASSERT_EQ(s.probes.size(), static_cast<std::size_t>(kProbes));
  for (int k = 0; k < kProbes; ++k) {
    EXPECT_EQ(s.probes[k].recompute_ranks.size(), k >= 2 ? 2u : 0u);
    EXPECT_EQ(s.probes[k].mode, k % 2 == 0 ? BackwardMode::kStandard : BackwardMode::kSplit);
    EXPECT_GT(s.probes[k].predicted_ms, 0.0);
    EXPECT_GT(s.probes[k].predicted_peak_bytes, 0.0);
  }
  ASSERT_GE(s.news.size(), 3u);
  EXPECT_NE(s.news[1].second.find("with every stage recomputing too"), std::string::npos) << s.news[1].second;
  EXPECT_NE(s.news[1].second.find("switching to 1f1b standard with recomputation"), std::string::npos)
      << s.news[1].second;
  // recompute_ranks[step] is the setting the chooser leaves for step + 1: the last probe step leaves the first
  // trial's, which the measured ranking picks (any setting; counted with the trials below).
  for (int step = 0; step < kProbes * kProbe - 1; ++step) {
    const bool probing_recomputation = step >= 2 * kProbe - 1;
    EXPECT_EQ(s.recompute_ranks[step].size(), probing_recomputation ? 2u : 0u) << step;
  }
  // Every setting ranked; the recomputing ones predict no more memory than the same form with fewer ranks
  // recomputing. Standard forms peak on the activations, which recomputation drops (strictly less with every rank
  // recomputing); 2BP forms may peak on the deferred W's inputs, which it keeps, plus a few bytes of its own per
  // micro-batch (seen: +8 bytes of 15 kB under ASan). Each memory model comes from its own probe, whose peaks move
  // by the few boundary messages a peer has not taken yet (a sent payload lives until the receiver takes it): 1 %
  // and 4 messages of slack.
  EXPECT_EQ(s.ranking.size(), 12u);
  auto peak = [&](const std::string& name, BackwardMode mode, std::size_t ranks) {
    for (const ScheduleCandidate& c : s.ranking) {
      if (c.name == name && c.mode == mode && c.recompute_ranks.size() == ranks) return c.predicted_peak_bytes;
    }
    ADD_FAILURE() << name << " with " << ranks << " recomputing ranks is not ranked";
    return 0.0;
  };
  for (const std::string name : {"1f1b", "gpipe"}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const double messages = 4.0 * kMicroBatchSize * kDim * sizeof(double);
      EXPECT_LE(peak(name, mode, 1), 1.01 * peak(name, mode, 0) + messages) << name;
      EXPECT_LE(peak(name, mode, 2), 1.01 * peak(name, mode, 1) + messages) << name;
      if (mode == BackwardMode::kStandard) EXPECT_LT(peak(name, mode, 2), peak(name, mode, 0)) << name;
    }
  }
  // The trials: 1f1b's two forms with one rank recomputing, gpipe's two forms in each of the 3 settings.
  std::map<std::size_t, int> trials_by_setting;
  for (int k = 0; k < kCandidates; ++k) {
    const int first = kProbes * kProbe + k * kVerify;  // the trial's first step
    ++trials_by_setting[s.recompute_ranks[first - 1].size()];
  }
  EXPECT_EQ(trials_by_setting, (std::map<std::size_t, int>{{0, 2}, {1, 4}, {2, 2}}));

  // A limit between 1f1b standard's peak with recomputation and the smallest without: the starting schedule is
  // over it, so the job ends on a recomputing form (whichever of those that fit measured faster), and says why.
  // The limited job measures its own memory models, whose peaks move by a few boundary messages from the first
  // job's (a payload lives until its receiver takes it; seen under load: 2 of 40 runs put 1f1b's forms under the
  // limit); the job is run again, up to 3 times, until its own models put the limit where it was meant to be.
  const double with = s.probes[2].predicted_peak_bytes;
  const double without = std::min(s.probes[0].predicted_peak_bytes, s.probes[1].predicted_peak_bytes);
  ASSERT_LT(with, without);
  const double limit = (with + without) / 2;
  std::vector<Seen> limited;
  std::string measured;
  for (int attempt = 0; attempt < 3; ++attempt) {
    limited = run_recomputing_auto(kProbes * kProbe + 2 * kVerify + 1, {"1f1b"}, 2, limit);
    const std::vector<ScheduleCandidate>& p = limited[0].probes;
    ASSERT_EQ(p.size(), static_cast<std::size_t>(kProbes));
    measured += fmt::format(" [{}, {}, {}]", p[0].predicted_peak_bytes, p[1].predicted_peak_bytes,
                            p[2].predicted_peak_bytes);
    if (std::min(p[0].predicted_peak_bytes, p[1].predicted_peak_bytes) > limit && p[2].predicted_peak_bytes < limit) {
      break;
    }
  }
  SCOPED_TRACE(fmt::format("limit {}; the limited job's 1f1b standard, 2BP, standard recomputing peaks:{}", limit,
                           measured));
  EXPECT_FALSE(limited[0].recompute_ranks.back().empty());
  for (int r = 0; r < 2; ++r) EXPECT_EQ(limited[r].recomputing_at_end, has_rank(limited[r].recompute_ranks.back(), r));
  ASSERT_FALSE(limited[0].news.empty());
  EXPECT_NE(limited[0].news.back().second.find("the starting schedule's predicted peak"), std::string::npos)
      << limited[0].news.back().second;
  EXPECT_NE(limited[0].news.back().second.find("is over the limit"), std::string::npos)
      << limited[0].news.back().second;
}

// AutoScheduleOptions::probe_weight_sizes: 1F1B's 2BP form runs one batched W per stage, so it is probed again
// with its W's one micro-batch at a time, right after it; that probe only measures. Every phase but that probe is
// slowed down here (a hook sleeps after each action), so it measures fastest of all -- and is still not chosen.
TEST(AutoSchedule, WeightSizesProbeMeasuresButIsNeverChosen) {
  Float64Default float64;
  constexpr int kProbe = 2, kMicroBatches = 4;
  const Schedule start = make_schedule("1f1b", ScheduleOptions{2, kMicroBatches, 1, BackwardMode::kSplit});
  torch::manual_seed(3);
  const auto inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const auto targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  TwoRanks ranks = two_rank_pipelines(start, fixture_options());
  const std::string single = "1f1b (one micro-batch per W)";
  std::vector<std::vector<ScheduleCandidate>> probes(2);
  std::vector<std::vector<double>> probe_ms(2);
  std::vector<std::string> last_line(2), final_name(2), first_line(2);
  std::mutex mutex;
  run_rank_threads(ranks.transports, [&](Transport& t) {
    const int r = t.rank();
    Pipeline& pipeline = *ranks.pipelines[r];
    pipeline.add_hook([&pipeline, &single](const ActionEvent&) {
      if (pipeline.schedule().name != single) std::this_thread::sleep_for(std::chrono::milliseconds(3));
    });
    AutoScheduleOptions o;
    o.probe_steps = o.verify_steps = kProbe;
    o.measure_candidates = 1;
    o.names = {"1f1b"};  // one name: the candidates are its two forms, both probed, so no trial follows
    o.probe_weight_sizes = true;
    AutoSchedule chooser(pipeline, o);
    std::vector<std::string> lines;
    for (int step = 0; step < 3 * kProbe; ++step) {
      std::optional<std::string> line = chooser.after_step(pipeline.step(inputs, targets));
      if (line) lines.push_back(*line);
    }
    EXPECT_EQ(chooser.phase(), AutoSchedule::Phase::kDone);
    std::lock_guard<std::mutex> lock(mutex);
    probes[r] = chooser.probes();
    probe_ms[r] = chooser.probe_ms();
    last_line[r] = lines.empty() ? "" : lines.back();
    first_line[r] = lines.empty() ? "" : lines.front();
    final_name[r] = pipeline.schedule().name;
  }).rethrow_root_cause();
  EXPECT_EQ(probe_ms[0], probe_ms[1]);
  ASSERT_EQ(probes[0].size(), 3u);  // 1f1b 2BP, its W's one by one, 1f1b standard
  EXPECT_EQ(probes[0][0].schedule.name, "1f1b");
  EXPECT_EQ(probes[0][1].schedule.name, single);
  EXPECT_EQ(probes[0][1].mode, BackwardMode::kSplit);
  EXPECT_EQ(probes[0][2].mode, BackwardMode::kStandard);
  for (const auto& list : probes[0][1].schedule.actions) {
    for (const Action& a : list) {
      if (a.type == ActionType::kBackwardWeight) EXPECT_EQ(a.micro_batches.size(), 1u) << describe(a);
    }
  }
  EXPECT_NE(first_line[0].find("its W's one micro-batch at a time too"), std::string::npos) << first_line[0];
  ASSERT_EQ(probe_ms[0].size(), 3u);
  EXPECT_LT(probe_ms[0][1], std::min(probe_ms[0][0], probe_ms[0][2])) << "the hook must slow the others down";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(final_name[r], "1f1b") << last_line[r];
    EXPECT_EQ(last_line[r].find("per W"), std::string::npos) << last_line[r];
  }
  // A 2BP form that batches no W (ZB-H1 runs each W alone) gets no such probe.
  TwoRanks zb = two_rank_pipelines(make_schedule("zb-h1", ScheduleOptions{2, kMicroBatches, 1, BackwardMode::kSplit}),
                                   fixture_options());
  AutoScheduleOptions o;
  o.probe_weight_sizes = true;
  EXPECT_EQ(AutoSchedule(*zb.pipelines[0], o).probes().size(), 2u);
}

TEST(AutoSchedule, RefusesBadOptionsAndMemoryBoundPipelines) {
  Float64Default float64;
  const Schedule sc = make_schedule("1f1b", ScheduleOptions{1, 2, 1, BackwardMode::kSplit});
  auto make = [&](PipelineOptions o) {
    auto module = make_chunk(0);
    auto* raw = module.get();
    std::vector<PipelineChunk> chunks;
    chunks.push_back({0, module, [raw](const at::Tensor& x) { return run_chunk(*raw, 0, x); }});
    return std::make_unique<Pipeline>(sc, std::move(chunks), std::shared_ptr<Transport>(std::move(make_local_transports(1)[0])),
                                      o);
  };
  auto plain = make(fixture_options());
  AutoScheduleOptions one_probe;
  one_probe.probe_steps = 1;
  EXPECT_THROW(AutoSchedule(*plain, one_probe), UsageError);
  AutoScheduleOptions none_measured;
  none_measured.measure_candidates = 0;
  EXPECT_THROW(AutoSchedule(*plain, none_measured), UsageError);
  PipelineOptions bounded = fixture_options();
  bounded.executor.max_pending_weight_micro_batches = 1;
  auto limited = make(bounded);
  try {
    AutoSchedule chooser(*limited, AutoScheduleOptions{});
    ADD_FAILURE() << "a memory-bound pipeline was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("memory"), std::string::npos) << e.what();
  }
  AutoScheduleOptions memory_limit;
  memory_limit.memory_limit_bytes = 1 << 30;
  try {  // a limit on the candidates needs their memory measured
    AutoSchedule chooser(*plain, memory_limit);
    ADD_FAILURE() << "a memory limit was accepted without record_memory";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("record_memory"), std::string::npos) << e.what();
  }
  for (const RankOptions& set : unusable_candidate_sets()) {  // refused at construction, not after the probe
    AutoScheduleOptions o;
    o.names = set.names;
    o.modes = set.modes;
    expect_error([&] { AutoSchedule chooser(*plain, o); }, {"AutoScheduleOptions", culprit(set)});
  }
  memory_limit.memory_limit_bytes = -1;
  PipelineOptions recording = fixture_options();
  recording.executor.record_memory = true;
  auto recorded = make(recording);
  EXPECT_THROW(AutoSchedule(*recorded, memory_limit), UsageError);
}

}  // namespace
}  // namespace twobp::testing
