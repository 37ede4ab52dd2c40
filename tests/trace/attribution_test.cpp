// Where a step's time went (twobp/trace/attribution.h): exact parts of made-up traces, and real pipelines of
// every built-in schedule in both modes, where the parts must sum to the measured step and name the slow peer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/overlap_hook.h"
#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/plan/measure.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/trace/attribution.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

TraceEvent event(ActionType type, int stage, int mb, double start, double end, double recompute = 0.0) {
  TraceEvent e;
  e.rank = 1;
  e.action.type = type;
  e.action.stage = stage;
  e.action.micro_batches = {mb};
  e.start_us = start;
  e.end_us = end;
  e.recompute_us = recompute;
  return e;
}

// Rank 1 of a 3-rank, 3-stage pipeline (stage s on rank s): every kind of action, gaps between them.
Trace made_up_rank1() {
  Trace t;
  t.events = {
      event(ActionType::kRecvForward, 1, 0, 5, 25),           // wait 20 for rank 0
      event(ActionType::kForward, 1, 0, 26, 36),              // F 10; 1 between
      event(ActionType::kSendForward, 1, 0, 36, 37),          // send 1
      event(ActionType::kRecvBackward, 1, 0, 37, 77),         // wait 40 for rank 2
      event(ActionType::kBackwardInput, 1, 0, 80, 95, 4),     // I 11 + recompute 4; 3 between
      event(ActionType::kSendBackward, 1, 0, 95, 96),         // send 1
      event(ActionType::kBackwardWeight, 1, 0, 96, 104),      // W 8
      event(ActionType::kForward, 1, 1, 104, 110),            // F 6
      event(ActionType::kBackward, 1, 1, 104, 110),           // B 6 over the same span: the F is not flagged as
  };                                                          // a pair, so both count (6 us twice)
  t.step_us = 130;  // finish 20
  return t;
}

Schedule three_stages() {
  Schedule s;
  s.name = "made-up";
  s.num_ranks = 3;
  s.num_stages = 3;
  s.num_micro_batches = 2;
  s.stage_to_rank = {0, 1, 2};
  s.actions.resize(3);
  return s;
}

TEST(Attribution, MadeUpTraceGivesExactParts) {
  const Trace trace = made_up_rank1();
  StepTimes times;
  times.pipeline_us = 150;    // 130 executor + 15 reduction wait + 5 around them
  times.reduce_wait_us = 15;
  times.optimizer_us = 7;
  times.step_us = 170;        // 13 idle at the end
  const StepAttribution a = attribute_step(three_stages(), trace, times);
  EXPECT_EQ(a.rank, 1);
  EXPECT_DOUBLE_EQ(a[StepPart::kWaitActivation], 20);
  EXPECT_DOUBLE_EQ(a[StepPart::kWaitGradient], 40);
  EXPECT_DOUBLE_EQ(a[StepPart::kForward], 16);
  EXPECT_DOUBLE_EQ(a[StepPart::kBackward], 6);
  EXPECT_DOUBLE_EQ(a[StepPart::kBackwardInput], 11);
  EXPECT_DOUBLE_EQ(a[StepPart::kRecompute], 4);
  EXPECT_DOUBLE_EQ(a[StepPart::kBackwardWeight], 8);
  EXPECT_DOUBLE_EQ(a[StepPart::kSend], 2);
  // 5 before the first action, 1 before the F, 3 before the I; the unflagged F and B overlap (0 between them,
  // and the B is counted in full: this made-up trace counts 6 us twice).
  EXPECT_DOUBLE_EQ(a[StepPart::kBetweenActions], 9);
  EXPECT_DOUBLE_EQ(a[StepPart::kFinish], 20);
  EXPECT_DOUBLE_EQ(a[StepPart::kReduceWait], 15);
  EXPECT_DOUBLE_EQ(a[StepPart::kPipelineOther], 5);
  EXPECT_DOUBLE_EQ(a[StepPart::kOptimizer], 7);
  EXPECT_DOUBLE_EQ(a[StepPart::kIdleEnd], 13);
  EXPECT_DOUBLE_EQ(a[StepPart::kOverlappedPair], 0);
  EXPECT_DOUBLE_EQ(a.step_us, 170);
  EXPECT_DOUBLE_EQ(a.parts_sum_us(), 176);  // the 6 us counted twice
  ASSERT_EQ(a.waits_by_peer_us.size(), 2u);
  EXPECT_DOUBLE_EQ(a.waits_by_peer_us.at(0)[0], 20);
  EXPECT_DOUBLE_EQ(a.waits_by_peer_us.at(2)[1], 40);
}

TEST(Attribution, OverlappedPairCountsItsSpanOnce) {
  Trace trace = made_up_rank1();
  trace.events[7].action.overlapped_with_next = true;  // now a pair: F and B share 104..110
  const StepAttribution a = attribute_step(three_stages(), trace);
  EXPECT_DOUBLE_EQ(a[StepPart::kOverlappedPair], 6);
  EXPECT_DOUBLE_EQ(a[StepPart::kForward], 10);
  EXPECT_DOUBLE_EQ(a[StepPart::kBackward], 0);
  // Without times around the step: the executor's step is the whole step, and the parts partition it.
  EXPECT_DOUBLE_EQ(a.step_us, 130);
  EXPECT_DOUBLE_EQ(a.parts_sum_us(), 130);
}

TEST(Attribution, TraceOfAnotherScheduleIsRefused) {
  Trace trace;
  trace.events = {event(ActionType::kRecvBackward, 2, 0, 0, 1)};  // stage 3 does not exist
  trace.step_us = 1;
  EXPECT_THROW(attribute_step(three_stages(), trace), UsageError);
}

TEST(Attribution, MeanKeepsTheSumAndRefusesMixedRanks) {
  const StepAttribution a = attribute_step(three_stages(), made_up_rank1());
  Trace slower = made_up_rank1();
  slower.step_us = 230;  // 100 more at the end
  const StepAttribution b = attribute_step(three_stages(), slower);
  const StepAttribution mean = mean_attribution({a, b});
  EXPECT_DOUBLE_EQ(mean.step_us, 180);
  EXPECT_DOUBLE_EQ(mean[StepPart::kFinish], 70);
  EXPECT_DOUBLE_EQ(mean.parts_sum_us(), 186);  // part by part: the 6 us each step counts twice, too
  EXPECT_DOUBLE_EQ(mean.waits_by_peer_us.at(2)[1], 40);
  StepAttribution other = a;
  other.rank = 0;
  EXPECT_THROW(mean_attribution({a, other}), UsageError);
  EXPECT_THROW(mean_attribution({}), UsageError);
}

TEST(Attribution, GatherGivesEveryRankEveryAttribution) {
  constexpr int kRanks = 3;
  auto transports = make_local_transports(kRanks);
  std::mutex mutex;
  std::vector<std::vector<StepAttribution>> got(kRanks);
  const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    StepAttribution mine;
    mine.rank = t.rank();
    mine.step_us = 100.0 + t.rank();
    mine[StepPart::kForward] = 10.0 * (t.rank() + 1);
    mine.waits_by_peer_us[(t.rank() + 1) % kRanks] = {1.5 * t.rank(), 2.5};
    auto all = gather_attributions(t, mine, std::chrono::seconds(30));
    std::lock_guard<std::mutex> lock(mutex);
    got[t.rank()] = std::move(all);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(got[r].size(), static_cast<std::size_t>(kRanks));
    for (int from = 0; from < kRanks; ++from) {
      const StepAttribution& a = got[r][from];
      EXPECT_EQ(a.rank, from);
      EXPECT_DOUBLE_EQ(a.step_us, 100.0 + from);
      EXPECT_DOUBLE_EQ(a[StepPart::kForward], 10.0 * (from + 1));
      ASSERT_EQ(a.waits_by_peer_us.size(), 1u) << "rank " << from;
      EXPECT_DOUBLE_EQ(a.waits_by_peer_us.at((from + 1) % kRanks)[0], 1.5 * from);
      EXPECT_DOUBLE_EQ(a.waits_by_peer_us.at((from + 1) % kRanks)[1], 2.5);
    }
  }
}

TEST(Attribution, SvgHasOneBarPerPartAndAnEscapedTitle) {
  StepAttribution a = attribute_step(three_stages(), made_up_rank1());
  StepAttribution b = a;
  b.rank = 2;
  const std::string svg = to_attribution_svg({a, b}, "1f1b <2BP> & more");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("1f1b &lt;2BP&gt; &amp; more"), std::string::npos);
  EXPECT_NE(svg.find(">rank 2</text>"), std::string::npos);
  int parts = 0;
  for (double us : a.parts_us) parts += us > 0 ? 1 : 0;
  std::size_t bars = 0;
  for (std::size_t at = svg.find("<title>"); at != std::string::npos; at = svg.find("<title>", at + 1)) ++bars;
  EXPECT_EQ(bars, 2u * static_cast<std::size_t>(parts));
  EXPECT_NE(svg.find("from rank 2 0.04 ms"), std::string::npos) << "a wait's tooltip names its peer";
  EXPECT_NE(format_attribution(a).find("longest wait: for rank 2"), std::string::npos) << format_attribution(a);
}

// Real pipelines: stage 1's forward sleeps, so its rank's F time has a known floor, and the rank of stage 0 waits
// for it. Every built-in schedule, both modes, p = 2: the parts sum to the step as each rank measured it.
struct RealCase {
  std::string schedule;
  BackwardMode mode;
  bool overlap = false;
  bool recompute = false;
};

std::string case_name(const ::testing::TestParamInfo<RealCase>& info) {
  std::string n = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard");
  if (info.param.overlap) n += "_overlap";
  if (info.param.recompute) n += "_recompute";
  for (char& c : n) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return n;
}

bool overlap_pairs_on(const Schedule& schedule, int rank) {
  for (const Action& a : schedule.actions[rank]) {
    if (a.overlapped_with_next) return true;
  }
  return false;
}

class RealPipeline : public ::testing::TestWithParam<RealCase> {};

TEST_P(RealPipeline, PartsSumToTheStepAndNameTheSlowPeer) {
  const RealCase c = GetParam();
  constexpr int kRanks = 2, kMicroBatches = 4, kSlowStage = 1;
  constexpr auto kSleep = std::chrono::milliseconds(10);
  const Schedule schedule =
      make_schedule(c.schedule, default_schedule_options(c.schedule, kRanks, kMicroBatches, c.mode));
  auto transports = make_local_transports(kRanks);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  PipelineOptions options;
  options.executor.timeout = std::chrono::seconds(60);
  options.loss = mse;
  std::atomic<int> overlap_calls{0};
  if (c.overlap) options.executor.overlap_forward_backward = concurrent_overlap(overlap_calls);
  for (int r = 0; r < kRanks; ++r) {
    std::vector<PipelineChunk> chunks;
    for (int s : schedule.stages_of(r)) {
      auto module = make_chunk(s);
      auto* raw = module.get();
      chunks.push_back({s, module,
                        [raw, s, kSleep](const at::Tensor& x) {
                          if (s == kSlowStage) std::this_thread::sleep_for(kSleep);
                          return run_chunk(*raw, s, x);
                        },
                        c.recompute});
    }
    pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks),
                                                   std::shared_ptr<Transport>(std::move(transports[r])), options));
  }
  torch::manual_seed(3);
  const auto inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  const auto targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  std::vector<StepAttribution> got(kRanks);
  std::vector<MeasuredCosts> measured(kRanks);
  std::vector<Transport*> ts;
  for (auto& p : pipelines) ts.push_back(&p->transport());
  const RankErrors errors = run_rank_threads(ts, [&](Transport& t) {
    Pipeline& p = *pipelines[t.rank()];
    for (int step = 0; step < 2; ++step) {  // the second step is attributed (the first one starts with a barrier)
      p.zero_grad();
      const auto t0 = std::chrono::steady_clock::now();
      const StepResult result = p.step(inputs, targets);
      StepTimes times;
      times.pipeline_us = result.pipeline_us;
      times.reduce_wait_us = result.reduce_wait_us;
      times.step_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      got[t.rank()] = attribute_step(p.schedule(), result.trace, times);
      ASSERT_GE(result.pipeline_us, result.trace.step_us);
      ASSERT_LE(result.trace.busy_us(), result.trace.step_us);  // a pair run at once counts once
      CostRecorder costs(p.schedule().num_stages);
      costs.add(result.trace);
      measured[t.rank()] = costs.local_medians();
    }
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  const int slow_rank = schedule.stage_to_rank[kSlowStage];
  int slow_forwards = 0;
  for (const Action& a : schedule.actions[slow_rank]) {
    if (a.type == ActionType::kForward && a.stage == kSlowStage) ++slow_forwards;
  }
  for (int r = 0; r < kRanks; ++r) {
    const StepAttribution& a = got[r];
    SCOPED_TRACE(format_attribution(a));
    EXPECT_EQ(a.rank, r);
    for (int part = 0; part < kNumStepParts; ++part) {
      EXPECT_GE(a.parts_us[part], 0.0) << to_string(static_cast<StepPart>(part));
    }
    EXPECT_NEAR(a.parts_sum_us(), a.step_us, 0.02 * a.step_us) << "the parts must sum to the step within 2 %";
    for (const auto& [peer, w] : a.waits_by_peer_us) {
      EXPECT_NE(peer, r);
      EXPECT_TRUE(peer >= 0 && peer < kRanks) << peer;
    }
    if (c.mode == BackwardMode::kStandard) {
      EXPECT_EQ(a[StepPart::kBackwardInput] + a[StepPart::kBackwardWeight], 0.0);
    } else if (!c.overlap) {
      EXPECT_GT(a[StepPart::kBackwardWeight], 0.0);
    }
    EXPECT_EQ(a[StepPart::kRecompute] > 0.0, c.recompute);
    EXPECT_EQ(a[StepPart::kOverlappedPair] > 0.0, c.overlap && overlap_pairs_on(schedule, r));
    // The cost recorder tells the pairs the hook ran at once by the same rule (ran_as_pair): all of them.
    int pairs = 0;
    for (const Action& action : schedule.actions[r]) pairs += action.overlapped_with_next ? 1 : 0;
    EXPECT_EQ(measured[r].overlapped_pairs, c.overlap ? pairs : 0);
    EXPECT_GE(measured[r].overlap, 0.0);
    EXPECT_LE(measured[r].overlap, 1.0);
  }
  // The slow stage's forwards (each sleeps; within a pair, or recomputed, the sleep counts where the pair or the
  // recomputation does) take at least their sleeps on its rank.
  const StepAttribution& slow = got[slow_rank];
  const double sleep_us = std::chrono::duration<double, std::micro>(kSleep).count();
  const double slept_us = sleep_us * slow_forwards;
  EXPECT_GE(slow[StepPart::kForward] + slow[StepPart::kOverlappedPair], 0.99 * slept_us);
  // The other rank cannot finish before the slow rank's forwards: it waited for that rank at least one sleep.
  const StepAttribution& other = got[1 - slow_rank];
  ASSERT_EQ(other.waits_by_peer_us.count(slow_rank), 1u);
  const auto& w = other.waits_by_peer_us.at(slow_rank);
  EXPECT_GE(w[0] + w[1], sleep_us);
}

std::vector<RealCase> real_cases() {
  std::vector<RealCase> cases;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) cases.push_back({name, mode});
  }
  cases.push_back({"dualpipev", BackwardMode::kSplit, /*overlap=*/true});
  cases.push_back({"dualpipev", BackwardMode::kStandard, /*overlap=*/true});
  cases.push_back({"1f1b", BackwardMode::kSplit, false, /*recompute=*/true});
  cases.push_back({"zb-v", BackwardMode::kStandard, false, /*recompute=*/true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EverySchedule, RealPipeline, ::testing::ValuesIn(real_cases()), case_name);

}  // namespace
}  // namespace twobp::testing
