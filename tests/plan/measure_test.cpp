// Measured costs and memory (twobp/plan/measure.h): traces written from known costs give those costs back, the
// simulator fed with them reproduces the traced step, the ranks agree on every stage, and the JSON form round-trips.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/plan/measure.h"
#include "twobp/runtime/launch.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/local.h"

namespace twobp {
namespace {

constexpr std::chrono::seconds kTimeout{30};

// Costs that differ per stage and per action type, so that a stage or type mixed up shows. With `fixed_w`, every
// W also has a fixed part (CostModel::backward_weight_fixed).
CostModel distinct_costs(int stages, BackwardMode mode, bool recompute, bool fixed_w = false) {
  CostModel c;
  for (int s = 0; s < stages; ++s) {
    c.forward.push_back(1.0 + 0.25 * s);
    c.backward_input.push_back(mode == BackwardMode::kSplit ? 1.5 + 0.125 * s : 0.0);
    c.backward_weight.push_back(mode == BackwardMode::kSplit ? 0.75 + 0.5 * s : 0.0);
    c.backward.push_back(2.0 + 0.375 * s);  // in 2BP form only for the B's a schedule fuses (DualPipeV's)
    if (recompute) c.recompute.push_back(0.5 + 0.0625 * s);
    if (fixed_w) c.backward_weight_fixed.push_back(0.4 + 0.3 * s);
  }
  c.communication = 0.3;
  return c;
}

// Whether stage `stage` of `sc` has an action of `type`.
bool has_action(const Schedule& sc, int stage, ActionType type) {
  for (const auto& list : sc.actions) {
    for (const Action& a : list) {
      if (a.stage == stage && a.type == type) return true;
    }
  }
  return false;
}

// `want` where stage s of `sc` has an action of `type`, else 0: what a run of `sc` can measure.
std::vector<double> where_present(const Schedule& sc, ActionType type, const std::vector<double>& want) {
  std::vector<double> out(want.size(), 0.0);
  for (std::size_t s = 0; s < want.size(); ++s) {
    if (has_action(sc, static_cast<int>(s), type)) out[s] = want[s];
  }
  return out;
}

// Each rank's trace of one step as the simulator runs it under `costs` (times in ms → µs), with the recomputation
// of each I and B marked as the runtime marks it.
std::vector<Trace> traces_of(const Schedule& sc, const CostModel& costs, const SimulationResult& sim) {
  std::vector<Trace> out(static_cast<std::size_t>(sc.num_ranks));
  for (const SimulatedEvent& e : sim.events) {
    TraceEvent t;
    t.rank = e.rank;
    t.action = e.action;
    t.start_us = e.start * 1000.0;
    t.end_us = e.end * 1000.0;
    const bool recomputes =
        e.action.type == ActionType::kBackwardInput || e.action.type == ActionType::kBackward;
    if (recomputes && !costs.recompute.empty()) t.recompute_us = costs.recompute[e.action.stage] * 1000.0;
    out[static_cast<std::size_t>(e.rank)].events.push_back(t);
  }
  for (Trace& t : out) t.step_us = sim.step_time * 1000.0;
  return out;
}

// Per stage of `sc`: the micro-batch counts of its W's.
std::vector<std::set<int>> weight_sizes(const Schedule& sc) {
  std::vector<std::set<int>> out(static_cast<std::size_t>(sc.num_stages));
  for (const auto& list : sc.actions) {
    for (const Action& a : list) {
      if (a.type == ActionType::kBackwardWeight) out[a.stage].insert(static_cast<int>(a.micro_batches.size()));
    }
  }
  return out;
}

// What CostRecorder gives back of `truth`'s W costs from a run of `sc` (its rule, twobp/plan/measure.h): {per
// micro-batch, fixed part} per stage -- both where the stage's W's came in several sizes, else the one size's
// duration per micro-batch and no fixed part; nothing where the stage has no W.
std::pair<std::vector<double>, std::vector<double>> recorded_weight(const Schedule& sc, const CostModel& truth) {
  std::vector<double> per_micro_batch(truth.backward_weight.size(), 0.0), fixed(truth.backward_weight.size(), 0.0);
  const std::vector<std::set<int>> sizes = weight_sizes(sc);
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    if (sizes[s].size() >= 2) {
      per_micro_batch[s] = truth.backward_weight[s];
      fixed[s] = truth.backward_weight_fixed.empty() ? 0.0 : truth.backward_weight_fixed[s];
    } else if (sizes[s].size() == 1) {
      const int k = *sizes[s].begin();
      per_micro_batch[s] = truth.weight(static_cast<int>(s), k) / k;
    }
  }
  if (std::all_of(fixed.begin(), fixed.end(), [](double x) { return x == 0.0; })) fixed.clear();
  return {per_micro_batch, fixed};
}

// Runs `body(rank, transport)` on `ranks` Local rank threads and fails the test on any rank's error.
template <typename Body>
void on_rank_threads(int ranks, Body body) {
  auto transports = make_local_transports(ranks);
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) { body(t.rank(), t); });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
}

void expect_same(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t s = 0; s < want.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-9) << what << " stage " << s;
}

// Overlapped pairs (Action::overlapped_with_next) in `sc`.
int pairs_in(const Schedule& sc) {
  int n = 0;
  for (const auto& list : sc.actions) {
    for (const Action& a : list) n += a.overlapped_with_next ? 1 : 0;
  }
  return n;
}

// The class of the case: every built-in schedule × mode × recomputation × (2BP) W with and without a fixed part ×
// overlapped pairs in order or run at once (CostModel::overlap: the traces then hold each pair as two events over
// its span, as the executor records a pair its hook ran), at a shape each takes. Each rank records only its own
// trace, the ranks agree, and the agreed costs are the costs the traces were made from (W as recorded_weight
// says; a part seen only inside pairs, as the B's of DualPipeV 2BP's first stage, solved from its pairs' spans),
// with the overlap; simulate() fed with them gives back the traced step time, and the traces' bubble is the
// simulator's (a pair's span counted once by both).
TEST(MeasuredCosts, TracesOfKnownCostsGiveThemBackAndReproduceTheStep) {
  int checked = 0, fixed_w_fitted = 0, overlapped = 0;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (auto [recompute, fixed_w, overlap] : std::vector<std::tuple<bool, bool, double>>{
               {false, false, 0.0}, {true, false, 0.0}, {false, true, 0.0}, {false, false, 0.375},
               {true, false, 0.75}}) {
        if (fixed_w && mode == BackwardMode::kStandard) continue;
        for (auto [p, m] : std::vector<std::pair<int, int>>{{2, 4}, {3, 7}, {4, 8}}) {
          Schedule sc;
          try {
            sc = make_schedule(name, default_schedule_options(name, p, m, mode));
          } catch (const ScheduleError&) {
            continue;  // a shape this schedule does not take
          }
          if (overlap > 0.0 && pairs_in(sc) == 0) continue;  // nothing to overlap
          const std::string what = name + (mode == BackwardMode::kSplit ? " 2bp" : " standard") +
                                   (recompute ? " recompute" : "") + (fixed_w ? " fixed W" : "") +
                                   (overlap > 0.0 ? " overlap " + std::to_string(overlap) : "") + " p=" +
                                   std::to_string(p) + " m=" + std::to_string(m);
          CostModel truth = distinct_costs(sc.num_stages, mode, recompute, fixed_w);
          truth.overlap = overlap;
          overlapped += overlap > 0.0 ? 1 : 0;
          const auto [want_w, want_w_fixed] = recorded_weight(sc, truth);
          fixed_w_fitted += want_w_fixed.empty() ? 0 : 1;
          const SimulationResult sim = simulate(sc, truth);
          const std::vector<Trace> traces = traces_of(sc, truth, sim);
          EXPECT_NEAR(bubble_fraction(traces), sim.bubble_fraction, 1e-9) << what;
          std::vector<MeasuredCosts> agreed(static_cast<std::size_t>(p));
          std::mutex mutex;
          on_rank_threads(p, [&](int rank, Transport& t) {
            CostRecorder recorder(sc.num_stages);
            recorder.add(traces[static_cast<std::size_t>(rank)]);
            recorder.add(traces[static_cast<std::size_t>(rank)]);  // a second, identical step: same medians
            MeasuredCosts mine = recorder.local_medians();
            if (rank == 0) mine.communication = truth.communication;
            MeasuredCosts all = agree_costs(t, mine, kTimeout);
            std::lock_guard<std::mutex> lock(mutex);
            agreed[static_cast<std::size_t>(rank)] = std::move(all);
          });
          for (int r = 0; r < p; ++r) {
            const MeasuredCosts& c = agreed[static_cast<std::size_t>(r)];
            const std::string who = what + " on rank " + std::to_string(r);
            expect_same(c.forward, truth.forward, who + " F");
            expect_same(c.backward_input, where_present(sc, ActionType::kBackwardInput, truth.backward_input),
                        who + " I");
            expect_same(c.backward_weight, want_w, who + " W");
            expect_same(c.backward_weight_fixed, want_w_fixed, who + " W0");
            expect_same(c.backward, where_present(sc, ActionType::kBackward, truth.backward), who + " B");
            expect_same(c.recompute, truth.recompute, who + " R");
            EXPECT_DOUBLE_EQ(c.communication, truth.communication) << who;
            EXPECT_NEAR(c.overlap, overlap, 1e-12) << who;
            EXPECT_EQ(c.overlapped_pairs, overlap > 0.0 ? 2 * pairs_in(sc) : 0) << who;  // 2 steps recorded
            const SimulationResult again = simulate(sc, c.cost_model(mode));
            EXPECT_NEAR(again.step_time, sim.step_time, 1e-9 * sim.step_time) << who;
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GE(checked, 5 * static_cast<int>(builtin_schedule_names().size()));
  EXPECT_GT(fixed_w_fitted, 0);  // some built-in runs W's of several sizes on a stage, so a fixed part is fitted
  EXPECT_GT(overlapped, 0);      // some built-in overlaps pairs (DualPipeV)
}

TEST(MeasuredCosts, WOfSeveralMicroBatchesCountsPerMicroBatchAndMediansAreMedians) {
  CostRecorder recorder(1);
  Trace trace;
  auto event = [](ActionType type, std::vector<int> mbs, double start_ms, double end_ms, double recompute_ms) {
    TraceEvent e;
    e.action.type = type;
    e.action.stage = 0;
    e.action.micro_batches = std::move(mbs);
    e.start_us = start_ms * 1000.0;
    e.end_us = end_ms * 1000.0;
    e.recompute_us = recompute_ms * 1000.0;
    return e;
  };
  trace.events = {event(ActionType::kForward, {0}, 0, 1, 0), event(ActionType::kForward, {1}, 1, 4, 0),
                  event(ActionType::kForward, {2}, 4, 6, 0), event(ActionType::kBackwardInput, {2}, 6, 10, 1),
                  event(ActionType::kBackwardWeight, {0, 1, 2}, 10, 16, 0)};
  recorder.add(trace);
  const MeasuredCosts c = recorder.local_medians();
  EXPECT_DOUBLE_EQ(c.forward[0], 2.0);          // median of 1, 3, 2
  EXPECT_DOUBLE_EQ(c.backward_input[0], 3.0);   // 4 less its 1 of recomputation
  EXPECT_DOUBLE_EQ(c.backward_weight[0], 2.0);  // 6 over 3 micro-batches
  EXPECT_DOUBLE_EQ(c.backward[0], 0.0);
  ASSERT_EQ(c.recompute.size(), 1u);
  EXPECT_DOUBLE_EQ(c.recompute[0], 1.0);
  EXPECT_EQ(recorder.steps(), 1);

  Trace bad;
  bad.events = {trace.events.front()};
  bad.events[0].action.stage = 1;
  EXPECT_THROW(recorder.add(bad), UsageError);
  EXPECT_THROW(CostRecorder(0), UsageError);
}

// W's of several sizes on one stage: the line through the median of each size, when batching is cheaper per
// micro-batch; the proportional rule when it is not. The simulator charges a W of k fixed + k * per micro-batch.
TEST(MeasuredCosts, WOfSeveralSizesFitsAFixedPartAndTheSimulatorChargesIt) {
  auto weight = [](std::vector<int> mbs, double ms) {
    TraceEvent e;
    e.action = Action{ActionType::kBackwardWeight, 0, std::move(mbs)};
    e.end_us = ms * 1000.0;
    return e;
  };
  {
    CostRecorder recorder(1);
    Trace trace;  // W = 0.5 + 1.5 k ms; the 9.0 for k = 1 is an outlier the median drops
    trace.events = {weight({0}, 2.0), weight({1}, 9.0), weight({2}, 2.0), weight({3, 4}, 3.5),
                    weight({5, 6, 7, 8}, 6.5)};
    recorder.add(trace);
    const MeasuredCosts c = recorder.local_medians();
    ASSERT_EQ(c.backward_weight_fixed.size(), 1u);
    EXPECT_NEAR(c.backward_weight_fixed[0], 0.5, 1e-12);
    EXPECT_NEAR(c.backward_weight[0], 1.5, 1e-12);
    const MeasuredCosts back = parse_measured_costs(measured_costs_json(c), "round trip with W0");
    EXPECT_EQ(back.backward_weight_fixed, c.backward_weight_fixed);
    EXPECT_EQ(back.backward_weight, c.backward_weight);

    // One rank, m = 3, 2BP GPipe: F F F I I I, then one W of the 3 micro-batches.
    MeasuredCosts run = c;
    run.forward = {1.0};
    run.backward_input = {2.0};
    run.backward = {0.0};
    const CostModel model = run.cost_model(BackwardMode::kSplit);
    EXPECT_DOUBLE_EQ(model.weight(0, 3), 0.5 + 3 * 1.5);
    EXPECT_DOUBLE_EQ(model.unfused_backward(0), 2.0 + 0.5 + 1.5);
    const Schedule gpipe = make_schedule("gpipe", default_schedule_options("gpipe", 1, 3, BackwardMode::kSplit));
    EXPECT_DOUBLE_EQ(simulate(gpipe, model).step_time, 3 * 1.0 + 3 * 2.0 + 0.5 + 3 * 1.5);
    // Its standard form from these 2BP costs: each B is I + a W of one micro-batch.
    const Schedule standard =
        make_schedule("gpipe", default_schedule_options("gpipe", 1, 3, BackwardMode::kStandard));
    CostModel fused = model;
    fused.backward.clear();
    EXPECT_DOUBLE_EQ(simulate(standard, fused).step_time, 3 * 1.0 + 3 * (2.0 + 0.5 + 1.5));

    CostModel bad = model;
    bad.backward_weight_fixed = {-1.0};
    EXPECT_THROW(simulate(gpipe, bad), UsageError);
    bad.backward_weight_fixed = {0.5, 0.5};
    EXPECT_THROW(simulate(gpipe, bad), UsageError);
  }
  {
    CostRecorder recorder(1);
    Trace trace;  // batched dearer per micro-batch (2 against 2.5): no fixed part, the median of 2 and 2.5
    trace.events = {weight({0}, 2.0), weight({1, 2, 3, 4}, 10.0)};
    recorder.add(trace);
    const MeasuredCosts c = recorder.local_medians();
    EXPECT_TRUE(c.backward_weight_fixed.empty());
    EXPECT_DOUBLE_EQ(c.backward_weight[0], 2.25);
    EXPECT_EQ(measured_costs_json(c).find("W0"), std::string::npos);
  }
}

// fit_weight_cost on durations measured elsewhere: the same rule, and bad input refused.
TEST(MeasuredCosts, FitWeightCostIsTheRecordersRule) {
  const WeightCost line = fit_weight_cost({{1, {8.0}}, {4, {20.0}}});
  EXPECT_DOUBLE_EQ(line.fixed, 4.0);
  EXPECT_DOUBLE_EQ(line.per_micro_batch, 4.0);
  const WeightCost one = fit_weight_cost({{4, {20.0, 24.0, 22.0}}});
  EXPECT_DOUBLE_EQ(one.fixed, 0.0);
  EXPECT_DOUBLE_EQ(one.per_micro_batch, 5.5);
  const WeightCost dearer = fit_weight_cost({{1, {8.0}}, {4, {40.0}}});  // batching dearer: proportional
  EXPECT_DOUBLE_EQ(dearer.fixed, 0.0);
  EXPECT_DOUBLE_EQ(dearer.per_micro_batch, 9.0);
  EXPECT_DOUBLE_EQ(fit_weight_cost({}).per_micro_batch, 0.0);
  EXPECT_THROW(fit_weight_cost({{0, {1.0}}}), UsageError);
  EXPECT_THROW(fit_weight_cost({{1, {-1.0}}}), UsageError);
  EXPECT_THROW(fit_weight_cost({{1, {std::nan("")}}}), UsageError);
}

TEST(MeasuredCosts, CostModelRefusesTheModeTheRunDidNotMeasure) {
  MeasuredCosts standard;
  standard.forward = {1.0, 1.0};
  standard.backward_input = standard.backward_weight = {0.0, 0.0};
  standard.backward = {2.0, 2.0};
  EXPECT_NO_THROW(standard.cost_model(BackwardMode::kStandard));
  EXPECT_THROW(standard.cost_model(BackwardMode::kSplit), UsageError);
  MeasuredCosts split = standard;
  split.backward = {0.0, 0.0};
  split.backward_input = {1.0, 1.0};
  split.backward_weight = {1.0, 1.0};
  EXPECT_THROW(split.cost_model(BackwardMode::kStandard), UsageError);
  const CostModel c = split.cost_model(BackwardMode::kSplit);
  EXPECT_TRUE(c.backward.empty());  // B = I + W in the simulator
  split.backward_weight = {1.0};
  EXPECT_THROW(split.cost_model(BackwardMode::kSplit), UsageError);
  EXPECT_THROW(MeasuredCosts{}.cost_model(BackwardMode::kSplit), UsageError);
}

TEST(MeasuredCosts, RanksWithDifferentStageCountsAreRefusedOnEveryRank) {
  auto transports = make_local_transports(2);
  std::mutex mutex;
  int refused = 0;
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    MeasuredCosts mine;
    const std::size_t S = t.rank() == 0 ? 2 : 3;
    mine.forward = mine.backward_input = mine.backward_weight = mine.backward = std::vector<double>(S, 1.0);
    try {
      agree_costs(t, mine, kTimeout);
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("stages"), std::string::npos) << e.what();
      std::lock_guard<std::mutex> lock(mutex);
      ++refused;
    }
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  EXPECT_EQ(refused, 2);
}

TEST(MeasuredCosts, JsonRoundTripsAndReadsAWholeBenchmarkResult) {
  MeasuredCosts c;
  c.forward = {1.25, 2.5};
  c.backward_input = {0.5, 0.75};
  c.backward_weight = {0.125, 0.0625};
  c.backward = {0.0, 0.0};
  c.communication = 0.03125;
  MeasuredCosts back = parse_measured_costs(measured_costs_json(c), "round trip");
  EXPECT_EQ(back.forward, c.forward);
  EXPECT_EQ(back.backward_input, c.backward_input);
  EXPECT_EQ(back.backward_weight, c.backward_weight);
  EXPECT_EQ(back.backward, c.backward);
  EXPECT_TRUE(back.recompute.empty());
  EXPECT_EQ(back.communication, c.communication);
  c.recompute = {0.25, 0.5};
  back = parse_measured_costs(measured_costs_json(c), "round trip with R");
  EXPECT_EQ(back.recompute, c.recompute);

  // A result of `twobp_bench pipeline --json` has more fields; only I and W present: B reads as 0 per stage.
  back = parse_measured_costs(
      R"({"schedule": "1f1b", "mode": "2bp", "communication_ms": 0.5, "costs_ms": {"F": [1, 2], "I": [3, 4], "W": [5, 6]}})",
      "result");
  EXPECT_EQ(back.backward, (std::vector<double>{0.0, 0.0}));
  EXPECT_EQ(back.backward_weight, (std::vector<double>{5.0, 6.0}));
  EXPECT_EQ(back.overlapped_pairs, 0);

  // Overlapped pairs run at once: written only when there were some, read back.
  EXPECT_EQ(measured_costs_json(c).find("overlap"), std::string::npos);
  c.overlap = 0.375;
  c.overlapped_pairs = 12;
  back = parse_measured_costs(measured_costs_json(c), "round trip with pairs");
  EXPECT_EQ(back.overlap, 0.375);
  EXPECT_EQ(back.overlapped_pairs, 12);
  EXPECT_EQ(back.cost_model(BackwardMode::kSplit).overlap, 0.375);
}

// agree_costs: the overlap of the job is the mean over every rank's pairs (a rank that ran none does not count),
// and the pairs add up.
TEST(MeasuredCosts, OverlapIsTheMeanOverTheRanksPairs) {
  std::vector<MeasuredCosts> agreed(3);
  std::mutex mutex;
  on_rank_threads(3, [&](int rank, Transport& t) {
    MeasuredCosts mine;
    mine.forward = mine.backward_input = mine.backward_weight = mine.backward = std::vector<double>(3, 0.0);
    mine.forward[rank] = 1.0;
    mine.overlap = std::vector<double>{0.25, 0.0, 1.0}[rank];
    mine.overlapped_pairs = std::vector<int>{3, 0, 1}[rank];
    MeasuredCosts all = agree_costs(t, mine, kTimeout);
    std::lock_guard<std::mutex> lock(mutex);
    agreed[rank] = std::move(all);
  });
  for (const MeasuredCosts& c : agreed) {
    EXPECT_DOUBLE_EQ(c.overlap, (3 * 0.25 + 1 * 1.0) / 4);
    EXPECT_EQ(c.overlapped_pairs, 4);
  }
}

TEST(MeasuredCosts, JsonReaderNamesWhatIsWrong) {
  auto fails_with = [](const std::string& text, const std::string& needle) {
    try {
      parse_measured_costs(text, "file.json: result 3");
      ADD_FAILURE() << "accepted " << text;
    } catch (const UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("file.json: result 3"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  fails_with("[1, 2]", "not a JSON object");
  fails_with("not json", "not a JSON object");
  fails_with(R"({"costs_ms": {"F": [1]}})", "communication_ms");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"I": [1]}})", "\"F\"");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": []}})", "empty");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1, 2], "I": [1]}})", "costs_ms.I has 1 stages");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1, -2]}})", "costs_ms.F[1]");
  fails_with(R"({"communication_ms": "x", "costs_ms": {"F": [1]}})", "communication_ms must be");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1], "R": 3}})", "costs_ms.R must be a list");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1]}, "overlap": 0.5})", "\"overlap\" must be");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1]}, "overlap": {"share": 0.5, "pairs": 0}})",
             "with n > 0");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1]}, "overlap": {"share": 1.5, "pairs": 2}})",
             "overlap.share must be a number in [0, 1]");
  fails_with(R"({"communication_ms": 0, "costs_ms": {"F": [1, 1e308]}})", "costs_ms.F[1] is 1e+308");
  fails_with(R"({"communication_ms": 2e9, "costs_ms": {"F": [1]}})", "communication_ms is 2000000000");
}

// Issue 69: the one check of measured costs (check_measured_costs; cost_model and the planners call it) refuses
// NaN, +inf, -inf, negative and huge entries of every list, naming where, the field and the stage; 0 is "not
// measured", taken.
TEST(MeasuredCosts, RefusesCostsThatAreNotCosts) {
  using List = std::vector<double> MeasuredCosts::*;
  const std::pair<const char*, List> lists[] = {
      {"costs_ms.F[1]", &MeasuredCosts::forward},       {"costs_ms.I[1]", &MeasuredCosts::backward_input},
      {"costs_ms.W[1]", &MeasuredCosts::backward_weight}, {"costs_ms.W0[1]", &MeasuredCosts::backward_weight_fixed},
      {"costs_ms.B[1]", &MeasuredCosts::backward},      {"costs_ms.R[1]", &MeasuredCosts::recompute}};
  const double inf = std::numeric_limits<double>::infinity();
  auto good = [] {
    MeasuredCosts c;
    c.forward = c.backward_input = c.backward_weight = c.backward_weight_fixed = c.recompute = {1.0, 1.0};
    c.backward = {0.0, 0.0};
    return c;
  };
  EXPECT_NO_THROW(check_measured_costs(good(), "run"));
  for (const auto& [field, list] : lists) {
    for (double bad : {std::nan(""), inf, -inf, -1.0, 1e308}) {
      MeasuredCosts c = good();
      (c.*list)[1] = bad;
      try {
        check_measured_costs(c, "run.json: result 2");
        ADD_FAILURE() << field << " = " << bad << " was taken";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("run.json: result 2: ") + field + " is "),
                  std::string::npos)
            << e.what();
      }
      EXPECT_THROW(c.cost_model(BackwardMode::kSplit), UsageError) << field << " = " << bad;
    }
  }
  for (double bad : {std::nan(""), inf, -inf, -1.0}) {
    MeasuredCosts c = good();
    c.communication = bad;
    EXPECT_THROW(check_measured_costs(c, "run"), UsageError) << "communication " << bad;
    c = good();
    c.overlap = bad;
    EXPECT_THROW(check_measured_costs(c, "run"), UsageError) << "overlap " << bad;
  }
}

// The memory model: traces written by walking a known model through each rank's actions (the walk
// simulate_peak_memory() makes) give the model back, its gradient allocation taken out of the first W or B.
// With `sent` > 0 every I and B also allocates a message of that size for the rank upstream, which frees it while
// this rank is between actions (what rank threads see; the last one after the step): the backward actions must
// come back within a quarter message of the truth (each rank here sends at least 4), not a whole one higher.
// With `kept` > 0 each stage's first weight action (W or B) allocates that much more, freed only after the step
// (data-parallel buckets): no free between actions accounts for it, so F, I and B come back exactly.
void check_known_model_given_back(double sent, double kept) {
  int checked = 0;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      Schedule sc;
      try {
        sc = make_schedule(name, default_schedule_options(name, 2, 4, mode));
      } catch (const ScheduleError&) {
        continue;
      }
      MemoryModel truth;
      truth.base = {1000.0, 2000.0};
      truth.stages.resize(static_cast<std::size_t>(sc.num_stages));
      truth.gradients.resize(static_cast<std::size_t>(sc.num_stages));
      for (int s = 0; s < sc.num_stages; ++s) {
        truth.stages[s][static_cast<int>(ActionType::kForward)] = {100.0 + s, 150.0 + s};
        truth.stages[s][static_cast<int>(ActionType::kBackwardInput)] = {-40.0, 30.0 + s};
        truth.stages[s][static_cast<int>(ActionType::kBackwardWeight)] = {-60.0 - s, 5.0};
        truth.stages[s][static_cast<int>(ActionType::kBackward)] = {-100.0 - s, 20.0};
        truth.gradients[s] = 64.0 * (s + 1);
      }
      std::vector<MemoryModel> agreed(2);
      std::vector<PeakMemory> compared(2);
      std::vector<double> measured(2);
      std::mutex mutex;
      on_rank_threads(2, [&](int rank, Transport& t) {
        std::vector<double> gradients(static_cast<std::size_t>(sc.num_stages), 0.0);
        for (int s : sc.stages_of(rank)) gradients[s] = truth.gradients[s];
        MemoryRecorder recorder(sc.num_stages, gradients);
        Trace trace;
        double level = truth.base[rank];
        std::vector<bool> has_gradients(static_cast<std::size_t>(sc.num_stages), false);
        for (const Action& a : sc.actions[rank]) {
          if (!is_compute(a.type)) continue;
          const ActionMemory& am = truth.stages[a.stage][static_cast<int>(a.type)];
          const double k = a.type == ActionType::kBackwardWeight ? static_cast<double>(a.micro_batches.size()) : 1.0;
          const bool weights = a.type == ActionType::kBackwardWeight || a.type == ActionType::kBackward;
          double g = 0.0, bucket = 0.0;
          if (weights && !has_gradients[a.stage]) {
            has_gradients[a.stage] = true;
            g = truth.gradients[a.stage];
            bucket = kept;
          }
          const bool sends = a.type == ActionType::kBackwardInput || a.type == ActionType::kBackward;
          const double message = sends && a.stage > 0 ? sent : 0.0;  // the first stage sends nothing upstream
          TraceEvent e;
          e.rank = rank;
          e.action = a;
          e.memory_before = static_cast<int64_t>(level);
          e.memory_peak = static_cast<int64_t>(level + g + k * am.rise + bucket);  // the message is in the rise
          level += g + k * am.added + message + bucket;
          e.memory_after = static_cast<int64_t>(level);
          trace.events.push_back(e);
          level -= message;  // freed by the receiver before this rank's next action
        }
        recorder.add(trace);
        double my_peak = 0.0;
        for (const TraceEvent& e : trace.events) my_peak = std::max(my_peak, static_cast<double>(e.memory_peak));
        PeakMemory peak = compare_peak_memory(t, sc, recorder, my_peak, kTimeout);
        std::lock_guard<std::mutex> lock(mutex);
        agreed[static_cast<std::size_t>(rank)] = peak.model;
        compared[static_cast<std::size_t>(rank)] = std::move(peak);
        measured[static_cast<std::size_t>(rank)] = my_peak;
      });
      const std::vector<double> peaks = simulate_peak_memory(sc, truth);
      for (int r = 0; r < 2; ++r) {
        const MemoryModel& got = agreed[static_cast<std::size_t>(r)];
        const std::string what = name + (mode == BackwardMode::kSplit ? " 2bp" : " standard") + " on rank " +
                                 std::to_string(r);
        EXPECT_EQ(got.base, truth.base) << what;
        EXPECT_EQ(got.gradients, truth.gradients) << what;
        for (int s = 0; s < sc.num_stages; ++s) {
          for (int t = 0; t < kNumActionTypes; ++t) {
            const ActionType type = static_cast<ActionType>(t);
            if (!is_compute(type)) continue;
            const bool present = has_action(sc, s, type);
            const ActionMemory want = present ? truth.stages[s][t] : ActionMemory{};
            const std::string where = what + " stage " + std::to_string(s) + " " + to_string(type);
            const bool backward = type == ActionType::kBackwardInput || type == ActionType::kBackward;
            if (kept > 0.0 && (type == ActionType::kBackwardWeight ||
                               (type == ActionType::kBackward && mode == BackwardMode::kSplit))) {
              continue;  // the bucket is in these medians (a split stage may run a single fused B)
            }
            if (sent > 0.0 && backward) {
              EXPECT_NEAR(got.stages[s][t].added, want.added, sent / 4) << where;
            } else {
              EXPECT_DOUBLE_EQ(got.stages[s][t].added, want.added) << where;
            }
            EXPECT_DOUBLE_EQ(got.stages[s][t].rise, want.rise) << where;
          }
        }
        if (sent == 0.0 && kept == 0.0) EXPECT_EQ(simulate_peak_memory(sc, got), peaks) << what;
        // compare_peak_memory: every rank's measured peak, the prediction of the agreed model, both less each
        // rank's base and gradients.
        const PeakMemory& c = compared[static_cast<std::size_t>(r)];
        EXPECT_EQ(c.measured, measured) << what;
        EXPECT_EQ(c.predicted, simulate_peak_memory(sc, got)) << what;
        for (int q = 0; q < 2; ++q) {
          double fixed = truth.base[q];
          for (int s : sc.stages_of(q)) fixed += truth.gradients[s];
          EXPECT_DOUBLE_EQ(c.measured_step[q], measured[q] - fixed) << what << " rank " << q;
          EXPECT_DOUBLE_EQ(c.predicted_step[q], c.predicted[q] - fixed) << what << " rank " << q;
          // The walk of the truth peaks where the traces did (what the memory model is for).
          if (sent == 0.0 && kept == 0.0) EXPECT_DOUBLE_EQ(c.predicted[q], measured[q]) << what << " rank " << q;
        }
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, static_cast<int>(builtin_schedule_names().size()));
}

TEST(MeasuredMemory, TracesOfAKnownModelGiveItBack) { check_known_model_given_back(0.0, 0.0); }

TEST(MeasuredMemory, MessagesFreedBetweenActionsLeaveTheModelClosed) { check_known_model_given_back(15.0, 0.0); }

TEST(MeasuredMemory, WhatAStepKeepsPastItsLastActionStaysInTheModel) { check_known_model_given_back(0.0, 48.0); }

TEST(MeasuredMemory, RefusesTracesWithoutMemoryAndWrongSizes) {
  MemoryRecorder recorder(2, {0.0, 0.0});
  Trace trace;
  TraceEvent e;
  e.action.type = ActionType::kForward;
  e.action.micro_batches = {0};
  trace.events = {e};  // memory_before = -1: the pipeline did not record memory
  EXPECT_THROW(recorder.add(trace), UsageError);
  EXPECT_THROW(MemoryRecorder(2, {0.0}), UsageError);
  EXPECT_THROW(recorder.local_medians(2, 2), UsageError);
}

// measure_message_ms: a message's one-way time between ranks 0 and 1 (half a round trip), the same number on every
// rank of the transport (the ranks beyond 1 only wait); 0 with one rank; at least one round trip.
TEST(MeasureMessage, HalfARoundTripTheSameOnEveryRank) {
  std::mutex mutex;
  std::vector<double> got(3, -1.0);
  on_rank_threads(3, [&](int rank, Transport& t) {
    const double ms = measure_message_ms(t, at::zeros({64, 32}), std::chrono::seconds(30), 5);
    std::lock_guard<std::mutex> lock(mutex);
    got[rank] = ms;
  });
  EXPECT_GT(got[0], 0.0);
  EXPECT_EQ(got[1], got[0]);
  EXPECT_EQ(got[2], got[0]);
  on_rank_threads(1, [&](int, Transport& t) {
    EXPECT_EQ(measure_message_ms(t, at::zeros({4}), std::chrono::seconds(1)), 0.0);
  });
  on_rank_threads(2, [&](int, Transport& t) {
    EXPECT_THROW(measure_message_ms(t, at::zeros({4}), std::chrono::seconds(1), 0), UsageError);
  });
}

}  // namespace
}  // namespace twobp
