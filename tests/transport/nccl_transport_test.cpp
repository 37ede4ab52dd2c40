// NcclTransport under mpiexec -n 1 / -n 2. Needs one CUDA device per rank: skips (with the reason) otherwise.
// On a single GPU only the setup and the MPI-backed collectives run; point-to-point needs 2 ranks, 2 GPUs.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/mpi_test_env.h"
#include "twobp/error.h"
#include "twobp/transport/nccl.h"
#include "transport/shard_cases.h"

namespace twobp {
namespace {

constexpr Duration kLong{60000};

/// Skips unless every rank has its own GPU. Every rank takes the same decision (device counts are per node,
/// and ctest runs all ranks on one node), so no rank is left waiting in a collective.
#define REQUIRE_GPUS(min_ranks)                                                                          \
  do {                                                                                                   \
    const int devices = static_cast<int>(c10::cuda::device_count());                                     \
    if (devices == 0) GTEST_SKIP() << "no CUDA device";                                                  \
    if (devices < mpitest::g_mpi->local_size())                                                          \
      GTEST_SKIP() << devices << " CUDA device(s) for " << mpitest::g_mpi->local_size() << " local ranks"; \
    if (mpitest::g_mpi->world_size() < (min_ranks))                                                      \
      GTEST_SKIP() << "needs mpiexec -n " << (min_ranks) << " or more (and as many GPUs)";              \
  } while (false)

NcclTransport& transport() {
  static NcclTransport t(*mpitest::g_mpi);
  return t;
}

TEST(NcclTransport, RingLinks) {
  EXPECT_TRUE(ring_links(1).empty());
  EXPECT_EQ(ring_links(2), (std::vector<std::pair<int, int>>{{0, 1}, {1, 0}}));
  EXPECT_EQ(ring_links(3), (std::vector<std::pair<int, int>>{{0, 1}, {0, 2}, {1, 0}, {1, 2}, {2, 0}, {2, 1}}));
}

TEST(NcclTransport, SetupAndCollectives) {
  REQUIRE_GPUS(1);
  auto& t = transport();
  const int n = t.world_size();
  EXPECT_EQ(t.name(), "nccl");
  EXPECT_TRUE(t.device().is_cuda());
  EXPECT_EQ(t.links(), ring_links(n));
  at::Tensor x = at::full({4}, static_cast<float>(t.rank() + 1), at::TensorOptions().device(t.device()));
  t.all_reduce_sum(x, kLong);
  EXPECT_TRUE(at::equal(x.cpu(), at::full({4}, n * (n + 1) / 2.0f)));
  t.barrier(kLong);
}

TEST(NcclTransport, RingExchange) {
  REQUIRE_GPUS(2);
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  auto opts = at::TensorOptions().device(t.device());
  for (auto type : {c10::kFloat, c10::kBFloat16, c10::kLong}) {
    for (int tag = 0; tag < 4; ++tag) {
      at::Tensor out = at::arange(1000, opts.dtype(at::kFloat)).add(me * 10 + tag).to(type);
      at::Tensor in = at::empty({1000}, opts.dtype(type));
      // Receive posted before the send on purpose: separate link streams must keep this deadlock-free.
      auto r = t.irecv(in, {prev, tag, "RECV ring"});
      auto s = t.isend(out, {next, tag, "SEND ring"});
      r->wait(kLong);
      s->wait(kLong);
      at::Tensor expect = at::arange(1000, opts.dtype(at::kFloat)).add(prev * 10 + tag).to(type);
      EXPECT_TRUE(at::equal(in, expect)) << c10::toString(type) << " tag " << tag;
    }
  }
  t.barrier(kLong);
}

TEST(NcclTransport, ProducedOnSideStreamIsOrdered) {
  REQUIRE_GPUS(2);
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  // Produce the tensor with a big kernel on a non-default current stream: the send must wait for it.
  auto side = c10::cuda::getStreamFromPool(false, t.device().index());
  c10::cuda::CUDAStreamGuard guard(side);
  auto opts = at::TensorOptions().device(t.device());
  at::Tensor a = at::rand({2048, 2048}, opts);
  at::Tensor out = a.mm(a).sum(0).mul(0).add(me + 1);
  at::Tensor in = at::empty({2048}, opts);
  auto r = t.irecv(in, {prev, 50, "r"});
  auto s = t.isend(out, {next, 50, "s"});
  r->wait(kLong);
  s->wait(kLong);
  EXPECT_TRUE(at::equal(in, at::full({2048}, static_cast<float>(prev + 1), opts)));
  t.barrier(kLong);
}

TEST(NcclTransport, ErrorsNamePeerAndLabel) {
  REQUIRE_GPUS(2);
  auto& t = transport();
  const int me = t.rank();
  at::Tensor cpu = at::zeros({2});
  EXPECT_THROW(t.isend(cpu, {(me + 1) % t.world_size(), 0, "cpu"}), UsageError);
  if (t.world_size() >= 4) {
    // Rank me+2 is not a ring neighbour: no link.
    at::Tensor x = at::zeros({2}, at::TensorOptions().device(t.device()));
    try {
      t.isend(x, {(me + 2) % t.world_size(), 0, "SEND_F far"});
      ADD_FAILURE() << "expected UsageError";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("no NCCL link"), std::string::npos) << e.what();
    }
  }
  t.barrier(kLong);
}

// reduce_scatter_sum / all_gather on the GPU (ncclReduceScatter / ncclAllGather, padded where the world does not
// divide n) and their async forms (tests/transport/shard_cases.h). NOT RUN ON A GPU YET.
TEST(NcclTransport, ShardedCollectives) {
  REQUIRE_GPUS(1);
  auto& t = transport();
  EXPECT_TRUE(t.asynchronous_sharded_collectives());
  testing::check_reduce_scatter_all_gather(t, kLong);
  testing::check_round_trip_matches_all_reduce(t, kLong, /*bitwise=*/false);  // NCCL's summation order
  testing::check_async_shards(t, kLong);
  testing::check_shard_argument_errors(t, kLong);
  t.barrier(kLong);
}

// Last: a timeout aborts the link's communicator.
TEST(NcclTransport, ZzTimeoutAbortsLink) {
  REQUIRE_GPUS(2);
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int prev = (me + n - 1) % n;
  at::Tensor in = at::empty({16}, at::TensorOptions().device(t.device()));
  auto r = t.irecv(in, {prev, 77, "RECV_F stage 1 micro-batch 0"});
  try {
    r->wait(Duration(300));
    ADD_FAILURE() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("RECV_F stage 1 micro-batch 0 from rank " + std::to_string(prev)),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(t.irecv(in, {prev, 78, "again"}), TransportError);
  t.barrier(kLong);
}

}  // namespace
}  // namespace twobp
