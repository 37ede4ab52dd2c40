// NcclTransport between 2 PROCESSES ON ONE GPU, launched without MPI (StoreTransport host, torchrun-like
// environment). NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), unless they
// look like different hosts: each rank gets its own NCCL_HOSTID, and with NCCL_SOCKET_IFNAME=lo and
// NCCL_IB_DISABLE=1 NCCL connects them through its socket transport over the loopback interface (slow, but every
// code path of the transport runs). This is the mode the single-GPU check machine can run; on a multi-GPU node
// the same test runs with one GPU per rank when TWOBP_NCCL_TEST_GPU_PER_RANK=1.
//
// Covers, each scenario in its own processes: construction (communicators + warm-up) and a ring exchange on both
// channels; one pipeline step of every built-in schedule in both modes against a single-process reference; a
// timeout that aborts the channel; a 64 MiB bfloat16 exchange, a slow producer and a bucket all-reduce beside a
// pending receive; and (4 processes) transport groups. Each rank marks its progress on stderr (a killed rank's
// last mark says where it stopped). Skips with the reason without a CUDA device.

#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/pipeline_fixtures.h"
#include "common/spawn_ranks.h"
#include "transport/group_cases.h"
#include "transport/shard_cases.h"
#include "twobp/error.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/nccl.h"
#include "twobp/transport/store.h"

namespace twobp {
namespace {

constexpr Duration kLong{60000};

// The children's variables: eager kernel loading (NcclTransport requires it, see its class comment; `loading`
// other than EAGER checks the refusal) and, unless TWOBP_NCCL_TEST_GPU_PER_RANK=1, one GPU shared by the ranks.
std::vector<std::string> child_env(int rank, const std::string& loading) {
  std::vector<std::string> env{"CUDA_MODULE_LOADING=" + loading};
  if (const char* v = std::getenv("TWOBP_NCCL_TEST_GPU_PER_RANK"); v != nullptr && std::string(v) == "1") return env;
  env.push_back("NCCL_HOSTID=twobp-test-host-" + std::to_string(rank));
  env.push_back("NCCL_SOCKET_IFNAME=lo");
  env.push_back("NCCL_IB_DISABLE=1");
  return env;
}

// Each scenario in its own processes, so that one that hangs or fails leaves the others' results.
void expect_ranks_pass(const std::string& scenario, int world, int seconds, const std::string& loading = "EAGER") {
  const auto codes = testing::run_processes("NcclRank.Run", scenario, world, std::chrono::seconds(seconds),
                                            [&](int rank) { return child_env(rank, loading); });
  ASSERT_EQ(codes.size(), static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " (its output is above)";
}

// Lazy kernel loading is refused at construction, before anything is posted, with what to do instead.
TEST(NcclProcesses, TwoRanksRefuseLazyKernelLoading) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_lazy", 2, 60, "LAZY");
}

// Construction (communicators + warm-up) and a ring exchange on two channels, three dtypes, then the all-reduce and
// barrier of the host.
TEST(NcclProcesses, TwoRanksOnOneGpu) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_ring", 2, 90);
}

// A receive that is never matched times out, names its message and aborts only its channel.
TEST(NcclProcesses, TwoRanksTimeoutAbortsChannel) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_timeout", 2, 90);
}

// One pipeline step of every built-in schedule in both modes against a single-process float64 reference. Timed out
// on an H200 at first (2026-12-04; rank 0 inside cuBLAS's first handle beside its posted receives); passed there
// the same day with the remedies in NcclTransport's class comment (cuBLAS handles first, receives_hold_device()).
TEST(NcclProcesses, TwoRanksEverySchedule) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_schedules", 2, 150);
}

// Streams and sizes: a 64 MiB bfloat16 exchange, a send whose tensor is produced by a deliberately slow kernel
// (a missing stream wait would send the old contents), and the collective communicator reducing a bucket while a
// receive is pending on a point-to-point channel. Passed on an H200 (2026-12-04).
TEST(NcclProcesses, TwoRanksStreamsAndCollectives) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_streams", 2, 150);
}

// Stream-side receives (NcclOptions::stream_waits; written 2026-12, NOT RUN ON A GPU YET): the slow producer and
// one pipeline step of 1F1B and ZB-V in both modes with the waits on the compute stream; a receive never matched
// returns from wait() at once, the watchdog aborts the communicators after its timeout (a host copy behind it then
// returns), and the next call raises the TimeoutError naming the wait; a pipeline whose peer never steps fails with
// the job-wide hang report (the board of the host store).
TEST(NcclProcesses, TwoRanksStreamWaits) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_stream_timeout", 2, 90);
  expect_ranks_pass("nccl_stream_waits", 2, 150);
}

// reduce_scatter_sum / all_gather on the GPU (tests/transport/shard_cases.h): sizes (padded where 2 does not divide
// n), dtypes, the round trip against all_reduce_sum, async forms, argument errors, and a size mismatch refused on
// both ranks by the first call's check over the host store. NOT RUN ON A GPU YET.
TEST(NcclProcesses, TwoRanksShardedCollectives) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_shards", 2, 150);
}

// Groups: 4 ranks split by rank % 2 and by rank / 2 (NcclTransport::split splits the StoreTransport host and
// builds each group's communicators through it). Passed on an H200 (2026-12-04).
TEST(NcclProcesses, FourRanksGroupsOnOneGpu) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  expect_ranks_pass("nccl_groups", 4, 240);
}

// A child rank's progress on stderr (unbuffered), with the seconds since it started: where a killed rank stopped.
void mark(int rank, const std::string& what) {
  static const auto start = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "[rank %d +%.1f s] %s\n", rank, s, what.c_str());
}

void ring(NcclTransport& t) {
  const int me = t.rank(), peer = 1 - me;
  auto opts = at::TensorOptions().device(t.device());
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    // Channel 1 is posted before channel 0 on the receiving side: separate communicators, no deadlock.
    at::Tensor in0 = at::empty({1000}, opts.dtype(dtype)), in1 = at::empty({1000}, opts.dtype(dtype));
    P2POptions r0{peer, 0, "RECV ring channel 0"}, r1{peer, 1, "RECV ring channel 1"};
    r1.channel = 1;
    auto w1 = t.irecv(in1, r1);
    auto w0 = t.irecv(in0, r0);
    P2POptions s0{peer, 0, "SEND ring channel 0"}, s1{peer, 1, "SEND ring channel 1"};
    s1.channel = 1;
    at::Tensor out0 = at::arange(1000, opts.dtype(at::kFloat)).add(me * 10).to(dtype);
    at::Tensor out1 = at::arange(1000, opts.dtype(at::kFloat)).add(me * 10 + 5).to(dtype);
    auto v0 = t.isend(out0, s0);
    auto v1 = t.isend(out1, s1);
    for (auto* w : {&w0, &w1, &v0, &v1}) (*w)->wait(kLong);
    EXPECT_TRUE(at::equal(in0, at::arange(1000, opts.dtype(at::kFloat)).add(peer * 10).to(dtype)));
    EXPECT_TRUE(at::equal(in1, at::arange(1000, opts.dtype(at::kFloat)).add(peer * 10 + 5).to(dtype)));
  }
  at::Tensor x = at::full({2}, static_cast<float>(me + 1), opts);
  t.all_reduce_sum(x, kLong);
  EXPECT_TRUE(at::equal(x.cpu(), at::full({2}, 3.0f)));
  t.barrier(kLong);
}

// 64 MiB of bfloat16 each way on channel 0; values are small integers, exact in bfloat16.
void large_exchange(NcclTransport& t) {
  const int me = t.rank(), peer = 1 - me;
  const std::int64_t n = 32 * 1024 * 1024;  // 2 bytes each
  auto opts = at::TensorOptions().device(t.device());
  auto pattern = [&](int who) {
    return at::arange(n, opts.dtype(at::kLong)).add(who).remainder(251).to(at::kBFloat16);
  };
  at::Tensor in = at::empty({n}, opts.dtype(at::kBFloat16));
  at::Tensor out = pattern(me);
  auto r = t.irecv(in, {peer, 0, "RECV 64 MiB"});
  auto s = t.isend(out, {peer, 0, "SEND 64 MiB"});
  s->wait(kLong);
  r->wait(kLong);
  EXPECT_TRUE(at::equal(in, pattern(peer))) << "rank " << me << ": the 64 MiB bfloat16 message arrived changed";
}

// The sender's tensor is written by a kernel queued after ~100 ms of GPU sleep on the compute stream; the send is
// posted at once. Only the transport's stream wait (channel stream after the compute stream) makes it send the
// new values; the receiver reads them on its compute stream right after wait().
void slow_producer(NcclTransport& t) {
  const int me = t.rank();
  const std::int64_t n = 4 * 1024 * 1024;
  auto opts = at::TensorOptions().device(t.device()).dtype(at::kFloat);
  if (me == 0) {
    at::Tensor out = at::zeros({n}, opts);
    at::cuda::sleep(200 * 1000 * 1000);  // ~0.1 s of clock cycles on the current stream
    out.fill_(7.0f);
    auto s = t.isend(out, {1, 0, "SEND slow producer"});
    s->wait(kLong);
  } else {
    at::Tensor in = at::zeros({n}, opts);
    auto r = t.irecv(in, {0, 0, "RECV slow producer"});
    r->wait(kLong);
    EXPECT_EQ(in.to(at::kDouble).sum().item<double>(), 7.0 * static_cast<double>(n))
        << "the receiver got the sender's tensor before its producing kernel ran";
  }
}

// Rank 0 posts a receive on channel 1 that rank 1 satisfies only after the reduction: the collective
// communicator (created at construction) must progress while that receive's kernel waits on its own stream.
void all_reduce_with_pending_receive(NcclTransport& t) {
  const int me = t.rank();
  auto opts = at::TensorOptions().device(t.device()).dtype(at::kFloat);
  at::Tensor pending = at::zeros({1024}, opts);
  P2POptions channel1{1 - me, 0, "RECV after the all-reduce"};
  channel1.channel = 1;
  std::unique_ptr<Work> r;
  if (me == 0) r = t.irecv(pending, channel1);
  at::Tensor bucket = at::full({4 * 1024 * 1024}, static_cast<float>(me + 1), opts);  // 16 MiB
  auto reduced = t.all_reduce_sum_async(bucket, kLong);
  reduced->wait(kLong);
  EXPECT_EQ(bucket.min().item<float>(), 3.0f);
  EXPECT_EQ(bucket.max().item<float>(), 3.0f);
  if (me == 1) {
    at::Tensor out = at::full({1024}, 5.0f, opts);
    t.isend(out, channel1)->wait(kLong);
  } else {
    r->wait(kLong);
    EXPECT_EQ(pending.sum().item<float>(), 5.0f * 1024);
  }
  t.barrier(kLong);
}

// `names`: empty = every built-in schedule.
void every_schedule(const std::shared_ptr<NcclTransport>& t, std::vector<std::string> names = {}) {
  using namespace testing;
  Float64Default float64;
  const int me = t->rank(), m = 4;
  const c10::Device dev = t->device();
  if (names.empty()) names = builtin_schedule_names();
  for (const auto& name : names) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const Schedule schedule = make_schedule(name, default_schedule_options(name, 2, m, mode));
      mark(me, name + (mode == BackwardMode::kSplit ? " 2bp" : " standard"));
      torch::manual_seed(21);
      auto inputs = torch::randn({m * kMicroBatchSize, kDim}), targets = torch::randn({m * kMicroBatchSize, kDim});
      Reference ref = run_reference(schedule.num_stages, m, inputs, targets);
      std::vector<PipelineChunk> chunks;
      std::map<int, std::shared_ptr<torch::nn::Module>> modules;
      for (int s : schedule.stages_of(me)) {
        auto module = make_chunk(s);
        module->to(dev);
        modules[s] = module;
        chunks.push_back({s, module, [raw = module.get(), s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
      }
      PipelineOptions o;
      o.executor.timeout = kLong;
      o.loss = mse;
      o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
      Pipeline p(schedule, std::move(chunks), t, o);
      auto result = p.step(inputs.to(dev), targets.to(dev));
      const std::string what = name + (mode == BackwardMode::kSplit ? " 2bp" : " standard");
      if (schedule.stage_to_rank.back() == me) {
        ASSERT_EQ(result.losses.size(), static_cast<std::size_t>(m)) << what;
        for (int mb = 0; mb < m; ++mb) EXPECT_NEAR(result.losses[mb], ref.losses[mb], 1e-9) << what;
      }
      for (auto& [s, module] : modules) {
        auto got = module->named_parameters();
        for (const auto& item : ref.chunks[s]->named_parameters()) {
          EXPECT_LE((got[item.key()].grad().cpu() - item.value().grad()).abs().max().item<double>(), 1e-9)
              << what << " stage " << s << " " << item.key();
        }
      }
      t->barrier(kLong);
    }
  }
}

void timeout_aborts_channel(NcclTransport& t) {
  at::Tensor in = at::empty({16}, at::TensorOptions().device(t.device()));
  if (t.rank() == 0) {
    auto r = t.irecv(in, {1, 77, "RECV_F stage 1 micro-batch 0"});
    try {
      r->wait(Duration(500));
      ADD_FAILURE() << "expected TimeoutError";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("RECV_F stage 1 micro-batch 0 from rank 1"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(t.irecv(in, {1, 78, "again"}), TransportError);
  }
  t.barrier(kLong);
}

// NcclOptions::stream_waits, on a transport built with it. See TwoRanksStreamWaits.
void stream_waits(const std::shared_ptr<NcclTransport>& t, Transport& host) {
  const int me = t->rank();
  slow_producer(*t);
  mark(me, "slow producer done (stream waits)");
  every_schedule(t, {"1f1b", "zb-v"});
  mark(me, "1f1b and zb-v done (stream waits)");

  // A pipeline whose rank 1 never steps: rank 0's step fails with a TimeoutError (a send waited on the host or a
  // receive's watchdog, whichever expires first) that carries the hang report over the store's board.
  {
    using namespace testing;
    Float64Default float64;
    const int m = 2;
    const Schedule schedule = make_schedule("1f1b", default_schedule_options("1f1b", 2, m, BackwardMode::kSplit));
    std::vector<PipelineChunk> chunks;
    for (int s : schedule.stages_of(me)) {
      auto module = make_chunk(s);
      module->to(t->device());
      chunks.push_back({s, module, [module, s](const at::Tensor& x) { return run_chunk(*module, s, x); }});
    }
    PipelineOptions o;
    o.executor.timeout = Duration(2000);
    o.loss = mse;
    o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
    Pipeline p(schedule, std::move(chunks), t, o);
    host.barrier(kLong);  // both pipelines exist: rank 1 answers the board from here on
    if (me == 0) {
      auto x = torch::randn({m * kMicroBatchSize, kDim}).to(t->device());
      try {
        p.step(x, x);
        ADD_FAILURE() << "expected TimeoutError";
      } catch (const TimeoutError& e) {
        const std::string text = e.what();
        EXPECT_NE(text.find("hang report ("), std::string::npos) << text;
        EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
      }
    } else {
      // Rank 0's failure aborts the job's host transport: this rank learns of it instead of timing out.
      EXPECT_THROW(host.barrier(kLong), Error);
    }
  }
}

// A receive that is never matched, waited on the stream: wait() returns at once; after the timeout the watchdog
// aborts the communicators, so that a host copy queued behind the wait returns; the next call raises.
void stream_wait_times_out(NcclTransport& t, Transport& host) {
  at::Tensor in = at::zeros({16}, at::TensorOptions().device(t.device()));
  if (t.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    auto r = t.irecv(in, {1, 77, "RECV_F stage 1 micro-batch 0"});
    r->wait(Duration(500));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(400)) << "wait() blocked";
    (void)in.sum().item<float>();  // behind the stream wait: returns once the watchdog aborted the transfer
    EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
    try {
      t.irecv(in, {1, 78, "again"});
      ADD_FAILURE() << "expected TimeoutError";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("waiting for RECV_F stage 1 micro-batch 0 from rank 1"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("waited on the stream"), std::string::npos) << e.what();
    }
    EXPECT_THROW(t.barrier(kLong), TimeoutError);
  }
  host.barrier(kLong);
}

TEST(NcclRank, Run) {
  const char* scenario_env = std::getenv("TWOBP_TEST_SCENARIO");
  if (scenario_env == nullptr) GTEST_SKIP() << "runs only as a child process of the NcclProcesses tests";
  testing::line_buffered_output();
  const std::string scenario = scenario_env;
  torch::set_num_threads(2);
  auto env = launch_env();
  ASSERT_TRUE(env);
  const int rank = env->rank;
  mark(rank, scenario + ": connecting the host store");
  auto host = std::make_shared<StoreTransport>(*env);
  NcclOptions options;
  options.local_rank = env->local_rank;
  options.local_size = env->local_size;
  if (std::getenv("NCCL_HOSTID") != nullptr) options.device = 0;  // both ranks on the one GPU
  options.init_timeout = kLong;
  if (scenario == "nccl_lazy") {
    try {
      NcclTransport refused(host, options);
      ADD_FAILURE() << "NcclTransport was built under lazy kernel loading";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA_MODULE_LOADING=EAGER"), std::string::npos) << e.what();
    }
    return;
  }
  options.stream_waits = scenario == "nccl_stream_waits" || scenario == "nccl_stream_timeout";
  mark(rank, "creating the NCCL communicators");
  auto t = std::make_shared<NcclTransport>(host, options);  // communicators + warm-up
  mark(rank, "communicators ready");
  EXPECT_EQ(t->pairing(), Pairing::kInOrderPerChannel);
  if (scenario == "nccl_groups") {
    testing::check_groups(*t, testing::GroupLayout::kByParity, kLong);
    testing::check_groups(*t, testing::GroupLayout::kByHalf, kLong);
  } else if (scenario == "nccl_streams") {
    large_exchange(*t);
    mark(rank, "64 MiB exchange done");
    slow_producer(*t);
    mark(rank, "slow producer done");
    all_reduce_with_pending_receive(*t);
  } else if (scenario == "nccl_shards") {
    // A mismatch first, so that it meets the first call's check; the transport stays usable after it.
    EXPECT_TRUE(testing::sharded_size_mismatch(*t, kLong, /*gather=*/false)) << "rank " << rank;
    EXPECT_TRUE(testing::sharded_size_mismatch(*t, kLong, /*gather=*/true)) << "rank " << rank;
    testing::check_reduce_scatter_all_gather(*t, kLong);
    mark(rank, "sizes and dtypes done");
    testing::check_round_trip_matches_all_reduce(*t, kLong, /*bitwise=*/false);
    testing::check_async_shards(*t, kLong);
    testing::check_shard_argument_errors(*t, kLong);
  } else if (scenario == "nccl_ring") {
    ring(*t);
  } else if (scenario == "nccl_schedules") {
    every_schedule(t);
  } else if (scenario == "nccl_timeout") {
    timeout_aborts_channel(*t);
  } else if (scenario == "nccl_stream_timeout") {
    stream_wait_times_out(*t, *host);
  } else if (scenario == "nccl_stream_waits") {
    stream_waits(t, *host);
  } else {
    FAIL() << "unknown scenario " << scenario;
  }
  mark(rank, "scenario done: destroying the transport");
  t.reset();
  host.reset();
  mark(rank, "destroyed");
}

}  // namespace
}  // namespace twobp
