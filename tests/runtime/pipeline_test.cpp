// The pipeline runtime against a single-process reference: every schedule, with and without 2BP, several
// (ranks, micro-batches) shapes, ranks as threads on the Local transport, float64.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

#include "common/overlap_hook.h"
#include "common/pairing_schedule.h"
#include "common/pipeline_fixtures.h"
#include "common/test_scale.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"
#include "twobp/transport/wrapping.h"

namespace twobp::testing {
namespace {

// A rank's transport that says whether its receives hold the device (as NCCL's do, Transport::
// receives_hold_device()) and logs the labels of the sends and receives the rank posts, in order.
class PostingLog final : public WrappingTransport {
 public:
  struct Entry {
    bool send;
    std::string label;
  };
  PostingLog(std::shared_ptr<Transport> inner, bool hold) : WrappingTransport(std::move(inner), "PostingLog"),
                                                            hold_(hold) {}
  bool receives_hold_device() const override { return hold_; }
  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override {
    log(true, options.label);
    return inner_->isend(tensor, options);
  }
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override {
    log(false, options.label);
    return inner_->irecv(buffer, options);
  }
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override {
    return std::make_unique<PostingLog>(std::shared_ptr<Transport>(inner_->split(color, key, timeout)), hold_);
  }
  std::vector<Entry> entries() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_;
  }

 private:
  void log(bool send, const std::string& label) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back({send, label});
  }
  const bool hold_;
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
};

// The first receive that `rank` posted before one of its own SENDs that precede that receive in its action list
// ("" when there is none): what a transport whose receives hold the device must never see.
std::string receive_posted_ahead_of_own_send(const Schedule& schedule, int rank,
                                             const std::vector<PostingLog::Entry>& entries) {
  const auto& actions = schedule.actions[rank];
  std::map<std::string, std::size_t> index_of;
  for (std::size_t i = 0; i < actions.size(); ++i) index_of[describe(actions[i])] = i;
  std::set<std::string> sent;
  for (const auto& e : entries) {
    const std::string action = e.label.substr(0, e.label.find(" ("));  // "(tensor k)", "(shape header)"
    if (e.send) {
      sent.insert(action);
      continue;
    }
    const auto at = index_of.find(action);
    if (at == index_of.end()) return "a receive of no action of this rank: " + e.label;
    for (std::size_t k = 0; k < at->second; ++k) {
      if (is_send(actions[k].type) && !sent.count(describe(actions[k]))) {
        return "rank " + std::to_string(rank) + " posted " + e.label + " before " + describe(actions[k]);
      }
    }
  }
  return "";
}

std::vector<Transport*> transports_of(const std::vector<std::unique_ptr<Pipeline>>& pipelines) {
  std::vector<Transport*> transports;
  for (const auto& p : pipelines) transports.push_back(&p->transport());
  return transports;
}

struct RankRun {
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;  // by stage, null when not on this rank
  StepResult result;
  std::exception_ptr error;
};

// Builds every rank's chunks on the calling thread (the global RNG is not thread-safe), then runs one step per
// rank on its own thread.
std::vector<RankRun> run_pipeline(const Schedule& schedule, const torch::Tensor& inputs, const torch::Tensor& targets,
                                  PipelineOptions options, int steps = 1,
                                  std::function<void(int rank, Pipeline&)> before_step = nullptr,
                                  LocalOptions transport_options = {}, bool recompute = false,
                                  std::vector<std::shared_ptr<PostingLog>>* logs = nullptr, bool hold = false) {
  std::vector<std::shared_ptr<Transport>> transports;
  for (auto& t : make_local_transports(schedule.num_ranks, transport_options)) transports.push_back(std::move(t));
  if (logs) {  // every rank's transport wrapped in a PostingLog
    logs->clear();
    for (auto& t : transports) t = logs->emplace_back(std::make_shared<PostingLog>(std::move(t), hold));
  }
  std::vector<RankRun> runs(schedule.num_ranks);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  for (int r = 0; r < schedule.num_ranks; ++r) {
    std::vector<PipelineChunk> chunks;
    runs[r].chunks.resize(schedule.num_stages);
    for (int s : schedule.stages_of(r)) {
      auto module = make_chunk(s);
      runs[r].chunks[s] = module;
      auto* raw = module.get();
      chunks.push_back({s, module, [raw, s](const at::Tensor& x) { return run_chunk(*raw, s, x); }, recompute});
    }
    pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks), transports[r], options));
  }
  RankErrors errors = run_rank_threads(
      transports_of(pipelines),
      [&](Transport& t) {
        const int r = t.rank();
        for (int i = 0; i < steps; ++i) {
          if (before_step) before_step(r, *pipelines[r]);
          runs[r].result = pipelines[r]->step(inputs, targets);
        }
      },
      /*abort_on_error=*/false);
  for (int r = 0; r < schedule.num_ranks; ++r) runs[r].error = errors.errors[r];
  return runs;
}

struct ParityCase {
  std::string schedule;
  BackwardMode mode;
  int p, m;
  Pairing pairing = Pairing::kByTag;  // of the Local transport: kInOrderPerChannel pairs like NCCL
  int max_pending_weight = 0;          // memory-bounded 2BP (ExecutorOptions::max_pending_weight_micro_batches)
  bool recompute = false;              // activation recomputation on every stage (PipelineChunk::recompute)
  bool overlap = false;  // ExecutorOptions::overlap_forward_backward: each pair's F on a thread of its own beside its B
  bool hold = false;     // a transport whose receives hold the device (as NCCL's): none posted ahead of own sends
};

class PipelineParity : public ::testing::TestWithParam<ParityCase> {
 protected:
  Float64Default float64_;
};

TEST_P(PipelineParity, LossesAndGradientsMatchSingleProcess) {
  const ParityCase c = GetParam();
  const ScheduleOptions so = default_schedule_options(c.schedule, c.p, c.m, c.mode);
  Schedule schedule;
  try {
    schedule = make_schedule(c.schedule, so);
  } catch (const ScheduleError& e) {
    GTEST_SKIP() << "schedule rejects this shape: " << e.what();
  }
  torch::manual_seed(1);
  auto inputs = torch::randn({c.m * kMicroBatchSize, kDim});
  auto targets = torch::randn({c.m * kMicroBatchSize, kDim});
  Reference ref = run_reference(schedule.num_stages, c.m, inputs, targets);
  LocalOptions transport_options;
  transport_options.pairing = c.pairing;
  PipelineOptions options = fixture_options();
  options.executor.max_pending_weight_micro_batches = c.max_pending_weight;
  std::atomic<int> overlap_calls{0};
  if (c.overlap) options.executor.overlap_forward_backward = concurrent_overlap(overlap_calls);
  // With a limit, no stage may hold more deferred W's than it after any action.
  auto check_limit = [&](int, Pipeline& p) {
    if (c.max_pending_weight == 0) return;
    p.add_hook([&p, limit = c.max_pending_weight](const ActionEvent& e) {
      for (int s : p.stage_indices()) {
        const std::size_t pending = p.stage(s).pending_weight_micro_batches();
        if (static_cast<int>(pending) > limit) {
          throw std::runtime_error("stage " + std::to_string(s) + " holds " + std::to_string(pending) +
                                   " deferred W's after " + describe(*e.action));
        }
      }
    });
  };
  std::vector<std::shared_ptr<PostingLog>> logs;
  auto runs = run_pipeline(schedule, inputs, targets, options, 1, check_limit, transport_options, c.recompute,
                           c.hold ? &logs : nullptr, c.hold);
  for (int r = 0; r < c.p; ++r) {
    if (runs[r].error) std::rethrow_exception(runs[r].error);
    if (c.hold) EXPECT_EQ(receive_posted_ahead_of_own_send(schedule, r, logs[r]->entries()), "");
    // With recomputation every I and B carries the time of the forward it re-ran first; nothing else does.
    for (const auto& e : runs[r].result.trace.events) {
      const bool opens = e.action.type == ActionType::kBackwardInput || e.action.type == ActionType::kBackward;
      EXPECT_EQ(e.recompute_us > 0, c.recompute && opens) << describe(e.action);
    }
  }
  // Every pair went through the hook, once (all ranks are threads of this process).
  if (c.overlap) EXPECT_EQ(overlap_calls.load(), overlapped_pairs(schedule));
  const int last_rank = schedule.stage_to_rank.back();
  ASSERT_EQ(runs[last_rank].result.losses.size(), static_cast<std::size_t>(c.m));
  for (int mb = 0; mb < c.m; ++mb) {
    EXPECT_NEAR(runs[last_rank].result.losses[mb], ref.losses[mb], 1e-12) << "loss of micro-batch " << mb;
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    const int r = schedule.stage_to_rank[s];
    auto got = runs[r].chunks[s]->named_parameters();
    for (const auto& item : ref.chunks[s]->named_parameters()) {
      const auto& g = got[item.key()].grad();
      ASSERT_TRUE(g.defined()) << "stage " << s << " " << item.key() << " has no gradient";
      EXPECT_LE((g - item.value().grad()).abs().max().item<double>(), 1e-12)
          << "stage " << s << " parameter " << item.key();
    }
  }
}

std::vector<ParityCase> all_cases() {
  std::vector<ParityCase> cases;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      // {4, 6}, {4, 3} and {3, 7}: micro-batch counts that are not multiples of p (for the interleaved schedules,
      // groups of 6, 3, and 4 + 3 micro-batches).
      // Reduced (sanitizers): one shape with m = 2p (recomputation) and two where p does not divide m.
      const std::vector<std::pair<int, int>> shapes =
          reduced_scale() ? std::vector<std::pair<int, int>>{{2, 4}, {4, 6}, {3, 7}}
                          : std::vector<std::pair<int, int>>{{2, 2}, {2, 4}, {4, 4}, {4, 8}, {4, 6}, {4, 3}, {3, 7}};
      for (auto [p, m] : shapes) {
        for (Pairing pairing : {Pairing::kByTag, Pairing::kInOrderPerChannel}) {
          cases.push_back({name, mode, p, m, pairing});
        }
        // Receives that hold the device, paired in order per channel: NCCL's two properties.
        cases.push_back({name, mode, p, m, Pairing::kInOrderPerChannel, 0, false, false, true});
        // Memory-bounded 2BP: W's run early when more than 1 (or 2) micro-batches wait for theirs.
        if (mode == BackwardMode::kSplit) {
          for (int limit : {1, 2}) cases.push_back({name, mode, p, m, Pairing::kByTag, limit});
        }
        // Activation recomputation on every stage.
        if (m == 2 * p) cases.push_back({name, mode, p, m, Pairing::kByTag, 0, true});
        // Overlapped F&B pairs run at once (schedules that have them at this shape), by tag and in order.
        Schedule sc;
        try {
          sc = make_schedule(name, default_schedule_options(name, p, m, mode));
        } catch (const ScheduleError&) {
          continue;
        }
        if (overlapped_pairs(sc) == 0) continue;
        for (Pairing pairing : {Pairing::kByTag, Pairing::kInOrderPerChannel}) {
          cases.push_back({name, mode, p, m, pairing, 0, false, true});
        }
        if (mode == BackwardMode::kSplit) cases.push_back({name, mode, p, m, Pairing::kByTag, 1, false, true});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, PipelineParity, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  std::string n = info.param.schedule + (info.param.mode == BackwardMode::kSplit ? "_2bp" : "_standard") + "_p" +
                  std::to_string(info.param.p) + "_m" + std::to_string(info.param.m) +
                  (info.param.pairing == Pairing::kByTag ? "" : "_in_order") +
                  (info.param.max_pending_weight > 0 ? "_pending_w" + std::to_string(info.param.max_pending_weight)
                                                     : std::string()) +
                  (info.param.recompute ? "_recompute" : "") + (info.param.overlap ? "_overlapped" : "") +
                  (info.param.hold ? "_receives_hold_device" : "");
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
});

// The check above can fail: where receives do not hold the device, a rank posts receives ahead (prefetch_receives)
// and rank 0 of 1F1B posts its first gradient receive before its first activation's send.
TEST(PipelineReceives, PostedAheadOfOwnSendsWhereTheyDoNotHoldTheDevice) {
  Float64Default float64;
  const Schedule schedule = make_schedule("1f1b", default_schedule_options("1f1b", 2, 4, BackwardMode::kSplit));
  auto inputs = torch::randn({4 * kMicroBatchSize, kDim}), targets = torch::randn({4 * kMicroBatchSize, kDim});
  for (bool hold : {false, true}) {
    std::vector<std::shared_ptr<PostingLog>> logs;
    auto runs = run_pipeline(schedule, inputs, targets, fixture_options(), 1, nullptr, {}, false, &logs, hold);
    for (const auto& run : runs) {
      if (run.error) std::rethrow_exception(run.error);
    }
    const std::string ahead = receive_posted_ahead_of_own_send(schedule, 0, logs[0]->entries());
    if (hold) {
      EXPECT_EQ(ahead, "");
    } else {
      EXPECT_NE(ahead.find("posted RECV_B"), std::string::npos) << ahead;
    }
  }
}

template <typename E>
bool is_a(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

class PipelineFailures : public ::testing::Test {
 protected:
  Float64Default float64_;
  Schedule schedule_ = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  torch::Tensor inputs_ = torch::randn({2 * kMicroBatchSize, kDim}, torch::kDouble);
  torch::Tensor targets_ = torch::randn({2 * kMicroBatchSize, kDim}, torch::kDouble);
};

TEST_F(PipelineFailures, ActivationOfUnexpectedShapeNamesBothStages) {
  auto options = fixture_options();
  options.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim + 1}, at::kDouble}; };
  const auto t0 = std::chrono::steady_clock::now();
  auto runs = run_pipeline(schedule_, inputs_, targets_, options);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  ASSERT_TRUE(runs[0].error);
  ASSERT_TRUE(is_a<UsageError>(runs[0].error)) << error_message(runs[0].error);
  const std::string what = error_message(runs[0].error);
  for (const char* word : {"stage 0 (rank 0)", "stage 1 (rank 1)", "micro-batch 0", "[2, 4]", "[2, 5]"}) {
    EXPECT_NE(what.find(word), std::string::npos) << word << " not in: " << what;
  }
  ASSERT_TRUE(runs[1].error) << "the peer must fail too, not hang";
  // With the root cause's type, marked as raised on rank 0 (util/failure.h).
  EXPECT_TRUE(is_a<UsageError>(runs[1].error)) << error_message(runs[1].error);
  EXPECT_TRUE(is_a<RaisedOnAnotherRank>(runs[1].error)) << error_message(runs[1].error);
  EXPECT_FALSE(is_a<RaisedOnAnotherRank>(runs[0].error)) << error_message(runs[0].error);
  EXPECT_NE(error_message(runs[1].error).find("rank 0"), std::string::npos) << error_message(runs[1].error);
}

// An overlap hook must run both parts of every pair exactly once; one that skips the B fails the step on the
// first pair with a UsageError (on every rank: the others with the root cause's type), instead of a step whose
// gradients silently lack that B.
TEST_F(PipelineFailures, OverlapHookThatSkipsAPartIsRefused) {
  const Schedule schedule = make_schedule("dualpipev", ScheduleOptions{2, 4, 2, BackwardMode::kStandard});
  ASSERT_GT(overlapped_pairs(schedule), 0);
  auto inputs = torch::randn({4 * kMicroBatchSize, kDim}), targets = torch::randn({4 * kMicroBatchSize, kDim});
  auto options = fixture_options();
  options.executor.overlap_forward_backward = [](const Action&, const Action&, const std::function<void()>& run_forward,
                                        const std::function<void()>&) { run_forward(); };
  auto runs = run_pipeline(schedule, inputs, targets, options);
  bool named = false;
  for (const auto& run : runs) {
    ASSERT_TRUE(run.error != nullptr);
    EXPECT_TRUE(is_a<UsageError>(run.error)) << error_message(run.error);
    named = named || error_message(run.error).find("exactly once") != std::string::npos;
  }
  EXPECT_TRUE(named);
}

// A LibTorch error inside an overlapped pair (here an out-of-memory from a gradient hook, raised only while a pair
// runs) keeps its type and names the pair -- the F and the B it ran beside -- on the failing rank, and the others
// fail too instead of waiting; in both modes of every schedule with overlapped pairs.
TEST_F(PipelineFailures, LibTorchErrorsInsideAnOverlappedPairNameThePair) {
  int checked = 0;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const Schedule schedule = make_schedule(name, default_schedule_options(name, 2, 4, mode));
      if (overlapped_pairs(schedule) == 0) continue;
      SCOPED_TRACE(name + (mode == BackwardMode::kSplit ? " 2bp" : " standard"));
      auto inputs = torch::randn({4 * kMicroBatchSize, kDim}), targets = torch::randn({4 * kMicroBatchSize, kDim});
      auto options = fixture_options();
      std::array<std::atomic<bool>, 2> in_pair{};  // per rank: its overlap hook is running a pair
      std::array<std::atomic<int>, 2> pairs{};
      options.executor.overlap_forward_backward = [&](const Action&, const Action& b, const std::function<void()>& f,
                                             const std::function<void()>& bwd) {
        const int rank = schedule.stage_to_rank.at(b.stage);
        ++pairs[rank];
        in_pair[rank] = true;
        f();
        bwd();
        in_pair[rank] = false;
      };
      // On the general-path (odd) stages, whose parameters run gradient hooks: every rank of a V holds one.
      auto runs = run_pipeline(schedule, inputs, targets, options, 1, [&](int rank, Pipeline& p) {
        for (int stage : p.stage_indices()) {
          if (stage % 2 == 0) continue;
          for (at::Tensor& w : p.stage(stage).parameters()) {
            w.register_hook([&in_pair, rank](const at::Tensor& grad) {
              TORCH_CHECK_WITH(OutOfMemoryError, !in_pair[rank].load(), "injected out of memory");
              return grad;
            });
          }
        }
      });
      ASSERT_GT(pairs[0].load() + pairs[1].load(), 0) << (runs[0].error ? error_message(runs[0].error) : "");
      int failed_in_pair = 0;
      for (const RankRun& run : runs) {
        ASSERT_TRUE(run.error) << "every rank must fail, none wait";
        const std::string what = error_message(run.error);
        if (is_a<RaisedOnAnotherRank>(run.error)) continue;
        // A rank aborted by the other before its own pair failed: LibTorch's types are not re-raised on peers (they
        // get a TransportError quoting the root's reason), so which rank reports what depends on timing.
        if (is_a<TransportError>(run.error) && what.find("failed (c10::OutOfMemoryError): injected out of memory") !=
                                                   std::string::npos) {
          continue;
        }
        ++failed_in_pair;
        EXPECT_TRUE(is_a<c10::OutOfMemoryError>(run.error)) << what;
        EXPECT_NE(what.find("injected out of memory"), std::string::npos) << what;
        EXPECT_NE(what.find("micro-batch"), std::string::npos) << what;
        EXPECT_NE(what.find(" overlapped with B stage "), std::string::npos) << what;
      }
      EXPECT_GE(failed_in_pair, 1);
      ++checked;
    }
  }
  EXPECT_GE(checked, 2);  // dualpipev in both modes at least
}

// Overlapped parts share one time span: their memory cannot be recorded or bounded per action.
TEST_F(PipelineFailures, OverlapHookWithMemoryRecordingIsRefusedAtConstruction) {
  const Schedule schedule = make_schedule("dualpipev", ScheduleOptions{2, 4, 2, BackwardMode::kStandard});
  auto options = fixture_options();
  options.executor.record_memory = true;
  options.executor.overlap_forward_backward = [](const Action&, const Action&, const std::function<void()>& f,
                                        const std::function<void()>& b) {
    f();
    b();
  };
  auto inputs = torch::randn({4 * kMicroBatchSize, kDim}), targets = torch::randn({4 * kMicroBatchSize, kDim});
  try {
    run_pipeline(schedule, inputs, targets, options);
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("record_memory and memory_limit_bytes off"), std::string::npos) << e.what();
  }
}

TEST_F(PipelineFailures, RankThatThrowsMakesPeersFailNamingIt) {
  auto options = fixture_options();
  // Rank 1 fails before its step; rank 0 is then waiting for gradients that will never come.
  auto runs = run_pipeline(schedule_, inputs_, targets_, options, 1, [](int rank, Pipeline& p) {
    if (rank == 1) {
      p.transport().abort("rank 1 failed: injected failure");
      throw std::runtime_error("injected failure");
    }
  });
  ASSERT_TRUE(runs[0].error);
  EXPECT_TRUE(is_a<TransportError>(runs[0].error)) << error_message(runs[0].error);
  EXPECT_NE(error_message(runs[0].error).find("injected failure"), std::string::npos) << error_message(runs[0].error);
}

TEST_F(PipelineFailures, PeerThatNeverSendsTimesOut) {
  auto options = fixture_options();
  options.executor.timeout = std::chrono::milliseconds(300);
  std::atomic<bool> release{false};
  // Rank 1 does not take part in the step at all (it sleeps past rank 0's timeout).
  auto runs = run_pipeline(schedule_, inputs_, targets_, options, 1, [&](int rank, Pipeline&) {
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      throw std::runtime_error("rank 1 skipped the step");
    }
  });
  ASSERT_TRUE(runs[0].error);
  const std::string what = error_message(runs[0].error);
  EXPECT_TRUE(is_a<TimeoutError>(runs[0].error)) << what;
  // Ranks as threads meet before their first step (Pipeline::run_step): the silent peer is named there.
  EXPECT_TRUE(what.find("rank 1") != std::string::npos || what.find("rank(s) 1") != std::string::npos) << what;
  EXPECT_NE(what.find("micro-batch"), std::string::npos) << what;
}

// LibTorch's own errors inside an action -- a dtype mismatch in the chunk's forward, a hook that fails in the
// backward -- say where in the pipeline they happened and keep their type (a caller may catch
// c10::OutOfMemoryError); the peers get the message without LibTorch's C++ backtrace.
TEST_F(PipelineFailures, LibTorchErrorsNameTheActionAndKeepTheirType) {
  auto expect_peer_names = [](const RankRun& peer, const std::string& type, const std::string& where) {
    ASSERT_TRUE(peer.error) << "the peer must fail too, not hang";
    const std::string what = error_message(peer.error);
    EXPECT_NE(what.find("failed (" + type + "): "), std::string::npos) << what;
    EXPECT_NE(what.find(where), std::string::npos) << what;
    EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
  };
  {
    SCOPED_TRACE("float32 inputs to a float64 chunk");
    auto runs = run_pipeline(schedule_, inputs_.to(torch::kFloat), targets_, fixture_options());
    ASSERT_TRUE(runs[0].error);
    try {
      std::rethrow_exception(runs[0].error);
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("(in rank 0: F stage 0 micro-batch 0)"),
                std::string::npos)
          << e.what_without_backtrace();
    }
    expect_peer_names(runs[1], "c10::Error", "in rank 0: F stage 0 micro-batch 0");
  }
  // An out-of-memory error from a gradient hook on rank 1's first (general-path) parameter.
  const auto inject_out_of_memory_on_rank_1 = [](int rank, Pipeline& p) {
    if (rank != 1) return;
    p.parameters().front().register_hook([](const at::Tensor& grad) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "injected out of memory");
      return grad;
    });
  };
  for (BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
    // A gradient hook on a general-path parameter runs in W with 2BP, in B without.
    const std::string where = std::string("in rank 1: ") + (mode == BackwardMode::kSplit ? "W" : "B") +
                              " stage 1 micro-batch" + (mode == BackwardMode::kSplit ? "es 0,1" : " 0");
    SCOPED_TRACE(where);
    const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, mode});
    auto runs = run_pipeline(schedule, inputs_, targets_, fixture_options(), 1, inject_out_of_memory_on_rank_1);
    ASSERT_TRUE(runs[1].error);
    EXPECT_TRUE(is_a<c10::OutOfMemoryError>(runs[1].error)) << error_message(runs[1].error);
    EXPECT_NE(error_message(runs[1].error).find(where), std::string::npos) << error_message(runs[1].error);
    // Rank 0 waits for the B's gradient; 2BP's deferred W's of the last rank come after it got all of them.
    if (mode == BackwardMode::kStandard) expect_peer_names(runs[0], "c10::OutOfMemoryError", where);
  }
  {
    // A W run early to bound the deferred W's (at most 1 pending): it names itself and the I it ran in.
    SCOPED_TRACE("a W run early");
    auto options = fixture_options();
    options.executor.max_pending_weight_micro_batches = 1;
    auto runs = run_pipeline(schedule_, inputs_, targets_, options, 1, inject_out_of_memory_on_rank_1);
    ASSERT_TRUE(runs[1].error);
    EXPECT_TRUE(is_a<c10::OutOfMemoryError>(runs[1].error)) << error_message(runs[1].error);
    const std::string what = error_message(runs[1].error);
    for (const char* where : {"in rank 1: W stage 1 micro-batch 0, run early to bound the deferred W's",
                              "in rank 1: I stage 1 micro-batch 1"}) {
      EXPECT_NE(what.find(where), std::string::npos) << what;
    }
  }
}

// An error of the user's own type inside an action (here a gradient hook) keeps its type on its rank -- the caller
// may catch it by that type, so the executor does not wrap it -- and the peers, which get it by message, are told
// its type and the action it escaped from.
struct ModelBug : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST_F(PipelineFailures, UserErrorsKeepTheirTypeAndThePeersAreToldTheAction) {
  const auto throw_on_rank_1 = [](int rank, Pipeline& p) {
    if (rank != 1) return;
    p.parameters().front().register_hook([](const at::Tensor& grad) -> at::Tensor { throw ModelBug("model bug"); });
  };
  for (BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
    const std::string where = std::string("(in rank 1: ") + (mode == BackwardMode::kSplit ? "W" : "B") +
                              " stage 1 micro-batch" + (mode == BackwardMode::kSplit ? "es 0,1)" : " 0)");
    SCOPED_TRACE(where);
    const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, mode});
    auto runs = run_pipeline(schedule, inputs_, targets_, fixture_options(), 1, throw_on_rank_1);
    ASSERT_TRUE(runs[1].error);
    EXPECT_TRUE(is_a<ModelBug>(runs[1].error)) << error_message(runs[1].error);
    EXPECT_EQ(error_message(runs[1].error), "model bug");
    if (mode == BackwardMode::kSplit) continue;  // 2BP's deferred W's of the last rank come after its last send
    ASSERT_TRUE(runs[0].error) << "the peer must fail too, not hang";
    const std::string what = error_message(runs[0].error);
    EXPECT_NE(what.find("rank 1 failed ("), std::string::npos) << what;
    EXPECT_NE(what.find("ModelBug): model bug " + where), std::string::npos) << what;
  }
}

// As loss.backward(): the loss must be one floating-point number per micro-batch.
TEST_F(PipelineFailures, LossThatIsNotAFloatingPointScalarIsRefused) {
  const std::vector<std::pair<std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>, std::string>>
      losses = {{[](const torch::Tensor& out, const torch::Tensor& t) { return (out - t).pow(2); }, "[2, 4] Double"},
                {[](const torch::Tensor& out, const torch::Tensor& t) { return (out - t).sum().gt(0).to(at::kLong); },
                 "[] Long"}};
  for (const auto& [loss, got] : losses) {
    auto options = fixture_options();
    options.loss = loss;
    auto runs = run_pipeline(schedule_, inputs_, targets_, options);
    ASSERT_TRUE(runs[1].error);
    EXPECT_TRUE(is_a<UsageError>(runs[1].error)) << error_message(runs[1].error);
    EXPECT_NE(error_message(runs[1].error)
                  .find("rank 1 stage 1 micro-batch 0: the loss must be a floating-point scalar, got " + got),
              std::string::npos)
        << error_message(runs[1].error);
  }
}

TEST_F(PipelineFailures, BatchThatDoesNotSplitIntoMicroBatches) {
  auto runs = run_pipeline(schedule_, torch::randn({3, kDim}, torch::kDouble), targets_, fixture_options());
  ASSERT_TRUE(runs[0].error);
  EXPECT_NE(error_message(runs[0].error).find("cannot be split into 2 micro-batches"), std::string::npos)
      << error_message(runs[0].error);
}

// A schedule that only by-tag transports can pair: it runs correctly on one, and a Pipeline on an in-order
// transport refuses it at construction, naming the channel, instead of swapping tensors at step 1.
TEST(PipelineSetup, ScheduleTheTransportCannotPairIsRefusedBeforeStepOne) {
  Float64Default float64;
  const Schedule schedule = breadth_first_vs_depth_first();
  torch::manual_seed(5);
  auto inputs = torch::randn({2 * kMicroBatchSize, kDim}), targets = torch::randn({2 * kMicroBatchSize, kDim});
  Reference ref = run_reference(schedule.num_stages, 2, inputs, targets);
  auto runs = run_pipeline(schedule, inputs, targets, fixture_options());
  for (const auto& run : runs) {
    if (run.error) std::rethrow_exception(run.error);
  }
  for (int mb = 0; mb < 2; ++mb) EXPECT_NEAR(runs[1].result.losses[mb], ref.losses[mb], 1e-12);

  LocalOptions in_order;
  in_order.pairing = Pairing::kInOrderPerChannel;
  auto transports = make_local_transports(2, in_order);
  std::vector<PipelineChunk> chunks;
  for (int s : {1, 3}) {
    auto module = make_chunk(s);
    chunks.push_back({s, module, [raw = module.get(), s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
  }
  try {
    Pipeline(schedule, std::move(chunks), std::move(transports[1]), fixture_options());
    ADD_FAILURE() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("in-order pairing: on channel 0 (activations) from rank 0 to rank 1"),
              std::string::npos)
        << e.what();
  }
}

// This process never installs the CPU allocation counter, so memory in bytes cannot be recorded or bounded:
// refused at construction, saying what to call, rather than reporting zeros or never bounding anything.
TEST(PipelineSetup, MemoryInBytesWithoutTheCpuCounterIsRefused) {
  auto schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  for (bool limit : {false, true}) {
    auto transports = make_local_transports(2);
    auto module = FastMlp(kDim);
    std::vector<PipelineChunk> chunks{{0, module.ptr(), [raw = module.ptr()](const at::Tensor& x) { return raw->forward(x); }}};
    PipelineOptions options = fixture_options();
    if (limit) {
      options.executor.memory_limit_bytes = 1 << 20;
    } else {
      options.executor.record_memory = true;
    }
    try {
      Pipeline(schedule, std::move(chunks), std::move(transports[0]), options);
      ADD_FAILURE() << "expected a UsageError";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("count_cpu_allocations()"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
    }
  }
}

TEST(PipelineSetup, ChunkOnTheWrongRankIsRejected) {
  auto schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  auto module = FastMlp(kDim);
  std::vector<PipelineChunk> chunks{{1, module.ptr(), [raw = module.ptr()](const at::Tensor& x) { return raw->forward(x); }}};
  EXPECT_THROW(Pipeline(schedule, std::move(chunks), std::move(transports[0]), fixture_options()), UsageError);
}

}  // namespace
}  // namespace twobp::testing

namespace twobp::testing {
namespace {

class PipelineNumerics : public ::testing::Test {
 protected:
  Float64Default float64_;
};

TEST_F(PipelineNumerics, SameSeedSameScheduleGivesBitwiseIdenticalLosses) {
  auto schedule = make_schedule("zb-h1", ScheduleOptions{4, 8, 1, BackwardMode::kSplit});
  torch::manual_seed(3);
  auto inputs = torch::randn({8 * kMicroBatchSize, kDim}), targets = torch::randn({8 * kMicroBatchSize, kDim});
  auto a = run_pipeline(schedule, inputs, targets, fixture_options());
  auto b = run_pipeline(schedule, inputs, targets, fixture_options());
  const int last = schedule.stage_to_rank.back();
  ASSERT_FALSE(a[last].error || b[last].error);
  ASSERT_EQ(a[last].result.losses.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(a[last].result.losses[i], b[last].result.losses[i]);  // bitwise
  for (int s = 0; s < schedule.num_stages; ++s) {
    const int r = schedule.stage_to_rank[s];
    auto pa = a[r].chunks[s]->parameters(), pb = b[r].chunks[s]->parameters();
    for (std::size_t k = 0; k < pa.size(); ++k) EXPECT_TRUE(torch::equal(pa[k].grad(), pb[k].grad()));
  }
}

// One Pipeline per rank of a 2-stage schedule (chunks 0 and 1), for tests that drive the ranks' threads themselves.
std::vector<std::unique_ptr<Pipeline>> make_two_rank_pipelines(const Schedule& schedule) {
  auto transports = make_local_transports(2);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  for (int r = 0; r < 2; ++r) {
    auto module = make_chunk(r);
    auto* raw = module.get();
    std::vector<PipelineChunk> chunks{{r, module, [raw, r](const at::Tensor& x) { return run_chunk(*raw, r, x); }}};
    pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(chunks),
                                                   std::shared_ptr<Transport>(std::move(transports[r])),
                                                   fixture_options()));
  }
  return pipelines;
}

// Poisons a parameter of stage 1 with NaN (the NaN then reaches stage 0 through the backward): every rank must
// reach the same verdict, and no optimizer may step.
TEST(PipelineGate, NonFiniteGradientsStopOrSkipOnEveryRank) {
  Float64Default float64;
  for (NonFinitePolicy policy : {NonFinitePolicy::kSkipStep, NonFinitePolicy::kStop}) {
    auto schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
    auto pipelines = make_two_rank_pipelines(schedule);
    {
      torch::NoGradGuard g;
      pipelines[1]->parameters()[0].fill_(std::numeric_limits<double>::quiet_NaN());
    }
    auto inputs = torch::randn({4, kDim}), targets = torch::randn({4, kDim});
    std::vector<int> ready(2, -1);
    std::vector<std::string> errors(2);
    RankErrors failed = run_rank_threads(
        transports_of(pipelines),
        [&](Transport& t) {
          const int r = t.rank();
          pipelines[r]->step(inputs, targets);
          ready[r] = pipelines[r]->ready_for_optimizer(/*step=*/7, policy, /*max_norm=*/1.0) ? 1 : 0;
        },
        /*abort_on_error=*/false);
    for (int r = 0; r < 2; ++r) {
      if (!failed.errors[r]) continue;
      try {
        std::rethrow_exception(failed.errors[r]);
      } catch (const NumericalError& e) {
        errors[r] = e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("unexpected: ") + e.what();
      }
    }
    for (int r = 0; r < 2; ++r) {
      if (policy == NonFinitePolicy::kSkipStep) {
        EXPECT_EQ(ready[r], 0) << "rank " << r << " " << errors[r];
        EXPECT_EQ(pipelines[r]->skipped_steps(), 1);
        for (const auto& p : pipelines[r]->parameters()) EXPECT_FALSE(p.grad().defined());
      } else {
        EXPECT_NE(errors[r].find("step 7"), std::string::npos) << "rank " << r << ": " << errors[r];
        EXPECT_NE(errors[r].find("stage(s) 0, 1"), std::string::npos) << "rank " << r << ": " << errors[r];
      }
    }
  }
}

TEST(PipelineGate, FiniteGradientsAreClippedToTheGlobalNorm) {
  Float64Default float64;
  auto schedule = make_schedule("gpipe", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto pipelines = make_two_rank_pipelines(schedule);
  auto inputs = torch::randn({4, kDim}) * 100, targets = torch::randn({4, kDim});
  std::vector<double> before(2), after(2);
  run_rank_threads(
      transports_of(pipelines),
      [&](Transport& t) {
        const int r = t.rank();
        pipelines[r]->step(inputs, targets);
        before[r] = pipelines[r]->global_grad_norm();
        EXPECT_TRUE(pipelines[r]->ready_for_optimizer(0, NonFinitePolicy::kStop, 0.5));
        after[r] = pipelines[r]->global_grad_norm();
      },
      /*abort_on_error=*/false)
      .rethrow_root_cause();
  EXPECT_EQ(before[0], before[1]);
  EXPECT_GT(before[0], 0.5);
  EXPECT_NEAR(after[0], 0.5, 1e-5);
}

}  // namespace
}  // namespace twobp::testing
