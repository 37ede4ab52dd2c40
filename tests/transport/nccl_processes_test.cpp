// NcclTransport between 2 PROCESSES ON ONE GPU, launched without MPI (StoreTransport host, torchrun-like
// environment). NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), unless they
// look like different hosts: each rank gets its own NCCL_HOSTID, and with NCCL_SOCKET_IFNAME=lo and
// NCCL_IB_DISABLE=1 NCCL connects them through its socket transport over the loopback interface (slow, but every
// code path of the transport runs). This is the mode the single-GPU check machine can run; on a multi-GPU node
// the same test runs with one GPU per rank when TWOBP_NCCL_TEST_GPU_PER_RANK=1.
//
// Covers: construction (communicators + warm-up), a ring exchange on both channels, one pipeline step of every
// built-in schedule (zb-v included) in both modes against a single-process reference, and a timeout that aborts
// the channel; and (4 processes) transport groups. Skips with the reason without a CUDA device.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

#include "common/pipeline_fixtures.h"
#include "common/spawn_ranks.h"
#include "transport/group_cases.h"
#include "twobp/error.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/nccl.h"
#include "twobp/transport/store.h"

namespace twobp {
namespace {

constexpr Duration kLong{60000};

std::vector<std::string> one_gpu_env(int rank) {
  if (const char* v = std::getenv("TWOBP_NCCL_TEST_GPU_PER_RANK"); v != nullptr && std::string(v) == "1") return {};
  return {"NCCL_HOSTID=twobp-test-host-" + std::to_string(rank), "NCCL_SOCKET_IFNAME=lo", "NCCL_IB_DISABLE=1"};
}

TEST(NcclProcesses, TwoRanksOnOneGpu) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  const auto codes = testing::run_processes("NcclRank.Run", "nccl", 2, std::chrono::seconds(150), one_gpu_env);
  ASSERT_EQ(codes.size(), 2u);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " (its output is above)";
}

// Groups: 4 ranks split by rank % 2 and by rank / 2 (NcclTransport::split splits the StoreTransport host and
// builds each group's communicators through it). Written without a GPU at hand: not yet run.
TEST(NcclProcesses, FourRanksGroupsOnOneGpu) {
  if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device (this test needs one GPU)";
  const auto codes =
      testing::run_processes("NcclRank.Run", "nccl_groups", 4, std::chrono::seconds(240), one_gpu_env);
  ASSERT_EQ(codes.size(), 4u);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " (its output is above)";
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

void every_schedule(const std::shared_ptr<NcclTransport>& t) {
  using namespace testing;
  Float64Default float64;
  const int me = t->rank(), m = 4;
  const c10::Device dev = t->device();
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const Schedule schedule = make_schedule(name, default_schedule_options(name, 2, m, mode));
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
      o.timeout = kLong;
      o.loss = mse;
      o.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
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

TEST(NcclRank, Run) {
  const char* scenario = std::getenv("TWOBP_TEST_SCENARIO");
  if (scenario == nullptr) GTEST_SKIP() << "runs only as a child process of NcclProcesses.TwoRanksOnOneGpu";
  torch::set_num_threads(2);
  auto env = launch_env();
  ASSERT_TRUE(env);
  auto host = std::make_shared<StoreTransport>(*env);
  NcclOptions options;
  options.local_rank = env->local_rank;
  options.local_size = env->local_size;
  if (std::getenv("NCCL_HOSTID") != nullptr) options.device = 0;  // both ranks on the one GPU
  options.init_timeout = kLong;
  auto t = std::make_shared<NcclTransport>(host, options);  // communicators + warm-up
  EXPECT_EQ(t->pairing(), Pairing::kInOrderPerChannel);
  if (std::string(scenario) == "nccl_groups") {
    testing::check_groups(*t, testing::GroupLayout::kByParity, kLong);
    testing::check_groups(*t, testing::GroupLayout::kByHalf, kLong);
    return;
  }
  ring(*t);
  every_schedule(t);
  timeout_aborts_channel(*t);
}

}  // namespace
}  // namespace twobp
