// Faults in the messages of a pipeline, through FaultInjectingTransport over the Local transport (by tag and in
// order): a job either ends with the gradients of a fault-free run, or every rank ends within its timeout with an
// error naming the rank, the peer and the message. Never a hang, never a silently different gradient.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/transport/fault_injection.h"
#include "twobp/transport/local.h"
#include "transport/shard_cases.h"

namespace twobp {
namespace {

using testing::kDim;
using testing::kMicroBatchSize;

constexpr int kRanks = 4, kMicroBatches = 8, kSteps = 2;

struct Outcome {
  std::vector<std::vector<at::Tensor>> grads;  // by rank: its chunks' parameter gradients after the last step
  std::vector<double> losses;                  // last stage's, last step
  std::vector<std::string> errors;             // by rank; empty: none
  double seconds = 0;
  int64_t faults = 0;                          // faults injected over all ranks
};

// A stall that is no message fault: a forward that takes too long, or a caller that stops calling step().
struct Stall {
  int stage = -1;           // the forward of this stage ...
  int call = 0;             // ... on its call-th call (0-based, counted over the run) ...
  double seconds = 0;       // ... sleeps this long
  int quit_rank = -1;       // this rank's caller returns instead of calling step() ...
  int quit_before_step = 0; // ... for this step
};

// One prepared run: kSteps steps of a schedule over kRanks thread ranks, each transport wrapped with a fault (or
// not wrapped).
struct Job {
  Stall stall;
  at::Tensor inputs, targets;
  std::vector<std::shared_ptr<Transport>> transports;
  std::vector<FaultInjectingTransport*> faulty;
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>> modules;  // by rank
};

// Builds a job under float64 as the default dtype (the caller holds it). Draws from LibTorch's default generator
// (the inputs and the chunks' initialisers), so jobs are prepared one at a time; execute() may then run beside
// other jobs.
std::unique_ptr<Job> prepare(const std::string& schedule_name, BackwardMode mode, Pairing pairing,
                             std::optional<FaultOptions> fault, Duration timeout, Stall stall) {
  auto job = std::make_unique<Job>();
  job->stall = stall;
  const Schedule schedule = make_schedule(
      schedule_name, default_schedule_options(schedule_name, kRanks, kMicroBatches, mode));
  torch::manual_seed(3);
  job->inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  job->targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  LocalOptions local;
  local.pairing = pairing;
  for (auto& t : make_local_transports(kRanks, local)) {
    std::shared_ptr<Transport> inner(std::move(t));
    if (fault) {
      auto wrapped = std::make_shared<FaultInjectingTransport>(inner, *fault);
      job->faulty.push_back(wrapped.get());
      job->transports.push_back(wrapped);
    } else {
      job->transports.push_back(inner);
    }
  }
  PipelineOptions options;
  options.executor.timeout = timeout;
  options.loss = testing::mse;
  options.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  job->modules.resize(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    std::vector<PipelineChunk> chunks;
    for (int s : schedule.stages_of(r)) {
      auto module = testing::make_chunk(s);
      job->modules[r].push_back(module);
      auto* raw = module.get();
      auto calls = std::make_shared<int>(0);  // this chunk's forwards so far (run on its rank's thread only)
      chunks.push_back({s, module, [raw, s, calls, stall](const at::Tensor& x) {
                          if (s == stall.stage && (*calls)++ == stall.call) {
                            std::this_thread::sleep_for(std::chrono::duration<double>(stall.seconds));
                          }
                          return testing::run_chunk(*raw, s, x);
                        }});
    }
    job->pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks), job->transports[r], options));
  }
  return job;
}

// Runs a prepared job's steps on its rank threads. Jobs share no transport, status board or generator; they share
// the CPU allocation counter's per-rank accounts, which no job here reads (no memory limit, no memory figures).
Outcome execute(Job& job) {
  Outcome out;
  out.grads.resize(kRanks);
  std::vector<Transport*> raw;
  for (auto& t : job.transports) raw.push_back(t.get());
  const Stall stall = job.stall;
  const auto t0 = std::chrono::steady_clock::now();
  const RankErrors errors = run_rank_threads(raw, [&](Transport& t) {
    Pipeline& p = *job.pipelines[t.rank()];
    for (int step = 0; step < kSteps; ++step) {
      if (t.rank() == stall.quit_rank && step == stall.quit_before_step) return;
      p.zero_grad();
      // Other inputs every step: a message of one step taken for another's would change the gradients.
      StepResult result = p.step(job.inputs * (step + 1), job.targets);
      if (!result.losses.empty()) out.losses = result.losses;  // the last stage's rank only
    }
  });
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int r = 0; r < kRanks; ++r) {
    out.errors.push_back(errors.errors[r] ? error_message(errors.errors[r]) : "");
    for (auto& m : job.modules[r]) {
      for (auto& p : m->parameters()) out.grads[r].push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    }
  }
  for (auto* f : job.faulty) out.faults += f->faults();
  return out;
}

Outcome run(const std::string& schedule_name, BackwardMode mode, Pairing pairing, std::optional<FaultOptions> fault,
            Duration timeout = std::chrono::seconds(60), Stall stall = {}) {
  testing::Float64Default float64;
  auto job = prepare(schedule_name, mode, pairing, fault, timeout, stall);
  return execute(*job);
}

void expect_same_gradients(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.losses, b.losses);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(a.grads[r].size(), b.grads[r].size());
    for (std::size_t k = 0; k < a.grads[r].size(); ++k) {
      ASSERT_TRUE(a.grads[r][k].defined() && b.grads[r][k].defined());
      EXPECT_TRUE(at::equal(a.grads[r][k], b.grads[r][k])) << "rank " << r << " parameter " << k;
    }
  }
}

void expect_every_rank_failed(const Outcome& o, double limit_s, const std::vector<std::string>& root_names) {
  EXPECT_LT(o.seconds, limit_s) << "took " << o.seconds << " s";
  for (int r = 0; r < kRanks; ++r) EXPECT_FALSE(o.errors[r].empty()) << "rank " << r << " finished";
  std::string all;
  for (const auto& e : o.errors) all += e + "\n";
  for (const auto& name : root_names) EXPECT_NE(all.find(name), std::string::npos) << name << " in:\n" << all;
}

struct Case {
  std::string schedule;
  BackwardMode mode;
  Pairing pairing;
};

const std::vector<Case> kCases = {{"1f1b", BackwardMode::kSplit, Pairing::kByTag},
                                  {"1f1b", BackwardMode::kStandard, Pairing::kInOrderPerChannel},
                                  {"zb-v", BackwardMode::kSplit, Pairing::kInOrderPerChannel},
                                  {"interleaved-1f1b", BackwardMode::kSplit, Pairing::kByTag},
                                  {"gpipe", BackwardMode::kStandard, Pairing::kByTag}};

// The faults whose runs wait out a timeout rather than compute: a lost message (rank 1 drops what it sends rank 2
// after 3 messages; 1.5 s timeout), a computation stuck past the timeout (the last stage's second forward sleeps
// 3 s; 1 s timeout) and a caller that stops calling step() (rank 2 before step 1; 1 s timeout).
enum class Waiting { kLostMessage, kStuckComputation, kCallerQuits };
constexpr Waiting kWaiting[] = {Waiting::kLostMessage, Waiting::kStuckComputation, Waiting::kCallerQuits};

std::unique_ptr<Job> prepare_waiting(const Case& c, Waiting w) {
  std::optional<FaultOptions> fault;
  Duration timeout = std::chrono::milliseconds(1000);
  Stall stall;
  switch (w) {
    case Waiting::kLostMessage:
      fault.emplace();
      fault->fault = Fault::kDrop;
      fault->ranks = {1};
      fault->peer = 2;
      fault->after_messages = 3;
      fault->probability = 1.0;
      timeout = std::chrono::milliseconds(1500);
      break;
    case Waiting::kStuckComputation:
      stall.stage = make_schedule(c.schedule, default_schedule_options(c.schedule, kRanks, kMicroBatches, c.mode))
                        .num_stages - 1;
      stall.call = 1;
      stall.seconds = 3.0;
      break;
    case Waiting::kCallerQuits:
      stall.quit_rank = 2;
      stall.quit_before_step = 1;
      break;
  }
  return prepare(c.schedule, c.mode, c.pairing, fault, timeout, stall);
}

// The outcome of waiting fault `w` for case `c`. The first call runs every case's waiting faults at once (each job
// on rank threads of its own; jobs share nothing they read), so the suite waits out each timeout once, not fifteen
// times; each test then checks its own outcome. Timeouts and stalls are those of a run alone.
const Outcome& waiting_outcome(const Case& c, Waiting w) {
  static std::once_flag once;
  static std::map<std::pair<std::string, int>, Outcome> outcomes;
  auto key = [](const Case& k, Waiting x) {
    return std::make_pair(k.schedule + "/" + std::to_string(static_cast<int>(k.mode)) + "/" +
                              std::to_string(static_cast<int>(k.pairing)),
                          static_cast<int>(x));
  };
  std::call_once(once, [&] {
    testing::Float64Default float64;  // held until every job has ended
    std::vector<std::pair<std::pair<std::string, int>, std::unique_ptr<Job>>> jobs;
    for (const Case& k : kCases) {
      for (Waiting x : kWaiting) jobs.emplace_back(key(k, x), prepare_waiting(k, x));
    }
    std::vector<std::future<Outcome>> running;
    for (auto& j : jobs) running.push_back(std::async(std::launch::async, [&j] { return execute(*j.second); }));
    for (std::size_t k = 0; k < jobs.size(); ++k) outcomes[jobs[k].first] = running[k].get();
  });
  return outcomes.at(key(c, w));
}

class FaultInjection : public ::testing::TestWithParam<Case> {};

TEST_P(FaultInjection, DelaysChangeNothing) {
  const Case c = GetParam();
  const Outcome clean = run(c.schedule, c.mode, c.pairing, std::nullopt);
  for (const auto& e : clean.errors) ASSERT_EQ(e, "");
  FaultOptions delay;
  delay.fault = Fault::kDelay;
  delay.probability = 0.3;
  delay.delay = Duration(3);
  delay.seed = 7;
  const Outcome late = run(c.schedule, c.mode, c.pairing, delay);
  for (const auto& e : late.errors) ASSERT_EQ(e, "");
  EXPECT_GT(late.faults, 0);
  expect_same_gradients(clean, late);
}

// The hang report (twobp/runtime/hang_report.h) that rides in the errors of `ranks` (default: every rank): the
// same text on each.
std::string same_report_on_every_rank(const Outcome& o, std::vector<int> ranks = {0, 1, 2, 3}) {
  std::string first;
  for (int r : ranks) {
    const auto at = o.errors[r].find("hang report (");
    EXPECT_NE(at, std::string::npos) << "rank " << r << ": " << o.errors[r];
    if (at == std::string::npos) return "";
    const std::string report = o.errors[r].substr(at);
    if (first.empty()) first = report;
    EXPECT_EQ(report, first) << "rank " << r;
  }
  return first;
}

TEST_P(FaultInjection, ALostMessageEndsEveryRankInTimeWithOneHangReport) {
  const Outcome& o = waiting_outcome(GetParam(), Waiting::kLostMessage);
  // Rank 2 waits for what rank 1 never sent: its error names rank 1 and the micro-batch it waited for.
  expect_every_rank_failed(o, 20.0, {"rank 1", "micro-batch"});
  EXPECT_GT(o.faults, 0);
  const std::string report = same_report_on_every_rank(o);
  const std::string verdict = report.substr(0, report.find('\n'));
  // Rank 2 waits for rank 1's message; rank 1 either finished its part (the message was lost) or waits in turn,
  // directly or around the ring of an interleaved schedule, on rank 2: a cycle through the edge 2 -> 1.
  const bool finished =
      verdict.find("rank 1 finished its part of run 0: a message it sent was lost") != std::string::npos;
  const bool cycle = verdict.find("wait on each other in a cycle: a message between them was lost") !=
                         std::string::npos &&
                     verdict.find("2 -> 1") != std::string::npos;
  EXPECT_TRUE(finished || cycle) << report;
  EXPECT_NE(report.find("rank 2: waiting"), std::string::npos) << report;
  EXPECT_NE(report.find("from rank 1 (run 0)"), std::string::npos) << report;
}

TEST_P(FaultInjection, AComputationStuckPastTheTimeoutIsNamedByEveryRank) {
  const Case c = GetParam();
  const Schedule schedule =
      make_schedule(c.schedule, default_schedule_options(c.schedule, kRanks, kMicroBatches, c.mode));
  const Outcome& o = waiting_outcome(c, Waiting::kStuckComputation);
  const int stuck_stage = schedule.num_stages - 1;
  const std::string report = same_report_on_every_rank(o);
  const int owner = schedule.stage_to_rank[stuck_stage];
  EXPECT_NE(report.substr(0, report.find('\n'))
                .find(fmt::format("rank {} is computing F stage {} micro-batch 1 for", owner, stuck_stage)),
            std::string::npos)
      << report;
  EXPECT_LT(o.seconds, 15.0);
}

TEST_P(FaultInjection, ACallerThatStopsCallingStepIsNamedByEveryRank) {
  const Outcome& o = waiting_outcome(GetParam(), Waiting::kCallerQuits);
  // Rank 2 returned without an error; every other rank fails with the same report naming it.
  EXPECT_EQ(o.errors[2], "");
  const std::string report = same_report_on_every_rank(o, {0, 1, 3});
  EXPECT_NE(report.find("rank 2 has not started run 1 (it ended run 0"), std::string::npos) << report;
}

TEST_P(FaultInjection, AFailedSendEndsEveryRankNamingTheMessage) {
  const Case c = GetParam();
  FaultOptions fail;
  fail.fault = Fault::kFailSend;
  fail.ranks = {2};
  fail.after_messages = 5;
  const Outcome o = run(c.schedule, c.mode, c.pairing, fail);
  expect_every_rank_failed(o, 20.0, {"rank 2: send of", "failed (injected fault)"});
}

TEST_P(FaultInjection, ARankThatDiesEndsEveryRankNamingIt) {
  const Case c = GetParam();
  FaultOptions die;
  die.fault = Fault::kDie;
  die.ranks = {3};
  die.after_messages = 4;
  const Outcome o = run(c.schedule, c.mode, c.pairing, die);
  expect_every_rank_failed(o, 20.0, {"rank 3 died after 4 messages"});
}

TEST_P(FaultInjection, ADuplicatedMessageNeverGivesADifferentGradient) {
  const Case c = GetParam();
  const Outcome clean = run(c.schedule, c.mode, c.pairing, std::nullopt);
  FaultOptions dup;
  dup.fault = Fault::kDuplicate;
  dup.ranks = {0};
  dup.label_contains = "micro-batch 2";  // one activation (and, where rank 0 sends them, gradients) of step 1
  dup.max_faults = 1;
  const Outcome o = run(c.schedule, c.mode, c.pairing, dup, std::chrono::seconds(5));
  EXPECT_GT(o.faults, 0);
  if (c.pairing == Pairing::kByTag) {
    // The copy carries the tag of its step (message_tag_span): no receive of the next step takes it.
    for (const auto& e : o.errors) ASSERT_EQ(e, "");
    expect_same_gradients(clean, o);
  } else {
    // In order, the copy takes the place of the next message on its channel: refused, naming both tags.
    expect_every_rank_failed(o, 30.0, {"matched it with rank 0's SEND_F stage 0 micro-batch 2", "expected tag"});
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard") +
                     (info.param.pairing == Pairing::kByTag ? "_by_tag" : "_in_order");
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Schedules, FaultInjection, ::testing::ValuesIn(kCases), case_name);

// Options that could inject nothing (or nonsense) are refused, each field on its own: a fault test must never pass
// because nothing was injected. The same options are accepted in a world large enough for them.
TEST(FaultInjectionOptions, OutOfRangeIsRefused) {
  constexpr int kWorld = 2;
  struct Bad {
    const char* what;  // the word the refusal must contain
    FaultOptions options;
  };
  std::vector<Bad> bad;
  auto with = [&](const char* what, auto set) {
    FaultOptions o;
    set(o);
    bad.push_back({what, o});
  };
  with("probability", [](FaultOptions& o) { o.probability = 1.5; });
  with("probability", [](FaultOptions& o) { o.probability = -0.1; });
  with("after_messages", [](FaultOptions& o) { o.after_messages = -1; });
  with("delay", [](FaultOptions& o) { o.delay = Duration(-1); });
  with("max_faults", [](FaultOptions& o) { o.max_faults = -2; });
  with("peer 2", [](FaultOptions& o) { o.peer = kWorld; });
  with("peer -2", [](FaultOptions& o) { o.peer = -2; });
  with("rank 2", [](FaultOptions& o) { o.ranks = {0, kWorld}; });
  with("rank -1", [](FaultOptions& o) { o.ranks = {-1}; });
  for (const Bad& b : bad) {
    auto t = std::move(make_local_transports(kWorld)[0]);
    try {
      FaultInjectingTransport(std::shared_ptr<Transport>(std::move(t)), b.options);
      ADD_FAILURE() << "accepted options out of range (" << b.what << ")";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(b.what), std::string::npos) << e.what();
    }
    EXPECT_THROW(check_fault_options(b.options, kWorld), UsageError) << b.what;
  }
  FaultOptions edge;  // the extremes that are in range
  edge.peer = kWorld - 1;
  edge.ranks = {0, kWorld - 1};
  edge.max_faults = -1;
  edge.probability = 0.0;
  EXPECT_NO_THROW(check_fault_options(edge, kWorld));
  EXPECT_THROW(check_fault_options(edge, kWorld - 1), UsageError);  // the same ranks in a smaller world
}

// Collectives are no messages: every fault passes reduce_scatter_sum and all_gather (and their async forms) through
// untouched -- a job's ZeRO-2 shards are exact whatever its messages suffer -- and counts none of them as a send.
TEST(FaultInjectionCollectives, ShardedCollectivesPassThroughEveryFault) {
  for (Fault fault : {Fault::kDelay, Fault::kDrop, Fault::kFailSend, Fault::kDie, Fault::kDuplicate, Fault::kReorder,
                      Fault::kCorrupt}) {
    SCOPED_TRACE(to_string(fault));
    auto locals = make_local_transports(3);
    std::vector<std::shared_ptr<FaultInjectingTransport>> faulty;
    std::vector<Transport*> raw;
    for (auto& t : locals) {
      FaultOptions f;
      f.fault = fault;  // every send of every rank, from the first
      faulty.push_back(std::make_shared<FaultInjectingTransport>(std::shared_ptr<Transport>(std::move(t)), f));
      raw.push_back(faulty.back().get());
    }
    const RankErrors errors = run_rank_threads(raw, [&](Transport& t) {
      testing::check_async_shards(t, Duration(10000));
      testing::check_round_trip_matches_all_reduce(t, Duration(10000), /*bitwise=*/true);
    });
    EXPECT_FALSE(errors.root_cause()) << error_message(errors.root_cause());
    for (const auto& f : faulty) {
      EXPECT_EQ(f->sends(), 0);
      EXPECT_EQ(f->faults(), 0);
    }
  }
}

}  // namespace
}  // namespace twobp
