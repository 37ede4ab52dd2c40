// MpiTransport under mpiexec -n 2 / -n 4: every rank runs every test. Tests that leave a rank's operation
// unmatched end with a barrier so the next test starts in step.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/mpi_test_env.h"
#include "twobp/error.h"
#include "twobp/transport/mpi.h"
#include "transport/group_cases.h"
#include "transport/shard_cases.h"

namespace twobp {
namespace {

using namespace std::chrono_literals;
constexpr Duration kLong{30000};

MpiTransport& transport() {
  static MpiTransport t(*mpitest::g_mpi);
  return t;
}

TEST(MpiEnvironment, RanksAndLauncher) {
  const auto& env = *mpitest::g_mpi;
  EXPECT_GE(env.world_size(), 2) << "run under mpiexec -n 2 or more";
  EXPECT_EQ(transport().rank(), env.rank());
  EXPECT_EQ(transport().world_size(), env.world_size());
  // All ranks of a ctest run share this node.
  EXPECT_EQ(env.local_size(), env.world_size());
  EXPECT_GE(env.local_rank(), 0);
  EXPECT_LT(env.local_rank(), env.local_size());
  EXPECT_TRUE(launched_by_mpi_launcher());
  EXPECT_EQ(transport().name(), "mpi");
  EXPECT_EQ(transport().device(), c10::Device(c10::kCPU));
}

TEST(MpiTransport, RingExchangeSeveralDtypes) {
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  const std::vector<c10::ScalarType> types = {c10::kFloat, c10::kDouble, c10::kHalf, c10::kBFloat16,
                                              c10::kLong,  c10::kInt,    c10::kBool};
  for (std::size_t i = 0; i < types.size(); ++i) {
    auto opts = at::TensorOptions().dtype(types[i]);
    at::Tensor out = at::arange(24, at::kDouble).add(me).remainder(7).to(types[i]).reshape({2, 3, 4});
    at::Tensor in = at::empty({2, 3, 4}, opts);
    auto r = t.irecv(in, P2POptions{prev, static_cast<int64_t>(i), "RECV ring"});
    auto s = t.isend(out, P2POptions{next, static_cast<int64_t>(i), "SEND ring"});
    s->wait(kLong);
    r->wait(kLong);
    at::Tensor expect = at::arange(24, at::kDouble).add(prev).remainder(7).to(types[i]).reshape({2, 3, 4});
    EXPECT_TRUE(at::equal(in, expect)) << c10::toString(types[i]);
  }
  // Large message (rendezvous protocol) and an empty one.
  at::Tensor big = at::full({1 << 20}, static_cast<float>(me));
  at::Tensor big_in = at::empty({1 << 20});
  auto r = t.irecv(big_in, P2POptions{prev, 100, "big"});
  auto s = t.isend(big, P2POptions{next, 100, "big"});
  while (!r->is_completed()) {
  }
  s->wait(kLong);
  EXPECT_TRUE(at::equal(big_in, at::full({1 << 20}, static_cast<float>(prev))));
  at::Tensor empty_in = at::empty({0, 3});
  auto r0 = t.irecv(empty_in, P2POptions{prev, 101, "empty"});
  t.isend(at::empty({0, 3}), P2POptions{next, 101, "empty"})->wait(kLong);
  r0->wait(kLong);
  t.barrier(kLong);
}

TEST(MpiTransport, OutOfOrderTagsAndHugeTags) {
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  const std::vector<std::int64_t> tags = {3, 1, 2, 0, (std::int64_t{1} << 40) + 5};
  std::vector<std::unique_ptr<Work>> sends;
  for (auto tag : tags) sends.push_back(t.isend(at::full({2}, static_cast<double>(tag % 1000)), {next, tag, "s"}));
  for (auto it = tags.rbegin(); it != tags.rend(); ++it) {
    at::Tensor buf = at::empty({2});
    t.irecv(buf, {prev, *it, "r"})->wait(kLong);
    EXPECT_EQ(buf[1].item<float>(), static_cast<float>(*it % 1000));
  }
  for (auto& s : sends) s->wait(kLong);
  t.barrier(kLong);
}

TEST(MpiTransport, FoldedTagCollisionIsDetected) {
  // With Open MPI's MPI_TAG_UB (2^31-1) tags are folded modulo 2^30: these two collide. A collision must be
  // reported, never deliver the other message silently; with a larger MPI_TAG_UB both simply arrive.
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  const std::int64_t a = 5, b = 5 + (std::int64_t{1} << 30);
  auto sa = t.isend(at::full({1}, 1.0), {next, a, "A"});
  auto sb = t.isend(at::full({1}, 2.0), {next, b, "B"});
  for (auto [tag, value] : {std::pair<std::int64_t, float>{b, 2.0f}, {a, 1.0f}}) {
    at::Tensor buf = at::empty({1});
    try {
      t.irecv(buf, {prev, tag, "recv"})->wait(kLong);
      EXPECT_EQ(buf.item<float>(), value);
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("fold"), std::string::npos) << e.what();
    }
  }
  sa->wait(kLong);
  sb->wait(kLong);
  t.barrier(kLong);
}

TEST(MpiTransport, ShapeMismatchNamesBothRanks) {
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  // Same byte count, other shape: caught by the header.
  {
    at::Tensor buf = at::empty({3, 2});
    auto r = t.irecv(buf, {prev, 7, "RECV_F stage 1 micro-batch 2"});
    auto s = t.isend(at::zeros({2, 3}), {next, 7, "SEND_F stage 0 micro-batch 2"});
    s->wait(kLong);
    try {
      r->wait(kLong);
      ADD_FAILURE() << "expected UsageError";
    } catch (const UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("rank " + std::to_string(me) + ": RECV_F stage 1 micro-batch 2 from rank " +
                         std::to_string(prev)),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("expected [3, 2] Float but rank " + std::to_string(prev) + " sent [2, 3] Float"),
                std::string::npos)
          << msg;
    }
  }
  // Larger payload than the buffer: MPI truncates, the error still explains it with shapes.
  {
    at::Tensor buf = at::empty({4}, at::kDouble);
    auto r = t.irecv(buf, {prev, 8, "RECV_B"});
    auto s = t.isend(at::zeros({16}, at::kDouble), {next, 8, "SEND_B"});
    try {
      r->wait(kLong);
      ADD_FAILURE() << "expected UsageError";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("sent [16] Double"), std::string::npos) << e.what();
    }
    // The sender's side may or may not complete depending on the protocol; it must not hang forever.
    try {
      s->wait(Duration(2000));
    } catch (const Error&) {
    }
  }
  t.barrier(kLong);
}

TEST(MpiTransport, TimeoutNamesPeerAndLabel) {
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  const int prev = (me + n - 1) % n;
  at::Tensor buf = at::empty({2});
  auto r = t.irecv(buf, {prev, 999, "RECV_F stage 1 micro-batch 0"});
  EXPECT_FALSE(r->is_completed());
  const auto start = std::chrono::steady_clock::now();
  try {
    r->wait(Duration(200));
    ADD_FAILURE() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_LT(std::chrono::steady_clock::now() - start, 3000ms);
    EXPECT_EQ(std::string(e.what()), "rank " + std::to_string(me) +
                                         ": timed out after 200 ms waiting for RECV_F stage 1 micro-batch 0 "
                                         "from rank " +
                                         std::to_string(prev));
  }
  r.reset();
  t.barrier(kLong);
  // The cancelled receive must not swallow a later message with the same tag.
  const int next = (me + 1) % n;
  at::Tensor in = at::empty({2});
  auto r2 = t.irecv(in, {prev, 999, "again"});
  t.isend(at::full({2}, 4.0), {next, 999, "again"})->wait(kLong);
  r2->wait(kLong);
  EXPECT_TRUE(at::equal(in, at::full({2}, 4.0)));
  t.barrier(kLong);
}

TEST(MpiTransport, AllReduceSum) {
  auto& t = transport();
  const int n = t.world_size(), me = t.rank();
  at::Tensor x = at::full({5}, static_cast<double>(me + 1), at::kDouble);
  t.all_reduce_sum(x, kLong);
  EXPECT_TRUE(at::equal(x, at::full({5}, n * (n + 1) / 2.0, at::kDouble)));
  at::Tensor h = at::full({3}, 0.5, at::kHalf);  // through float32
  t.all_reduce_sum(h, kLong);
  EXPECT_TRUE(at::equal(h, at::full({3}, 0.5 * n, at::kHalf)));
  at::Tensor nc = at::ones({4, 3}).t();  // non-contiguous
  t.all_reduce_sum(nc, kLong);
  EXPECT_TRUE(at::equal(nc, at::full({3, 4}, static_cast<float>(n))));
  at::Tensor l = at::full({1}, me, at::kLong);
  t.all_reduce_sum(l, kLong);
  EXPECT_EQ(l.item<int64_t>(), n * (n - 1) / 2);
  at::Tensor b = at::ones({1}, at::kBool);
  EXPECT_THROW(t.all_reduce_sum(b, kLong), UsageError);
}

TEST(MpiTransport, AsynchronousAllReduces) { testing::check_async_all_reduce(transport(), kLong); }

// No rank leaves a barrier before every rank has entered it: before each barrier every rank but 0 leaves a marker
// file (the last one after a pause), and rank 0 finds them all once the barrier lets it through. The ranks of one
// job share their parent (mpiexec's daemon on this node), which names the files.
TEST(MpiTransport, BarrierWaitsForEveryRank) {
  auto& t = transport();
  const std::string base = "/tmp/twobp_barrier_" + std::to_string(::getppid()) + "_";
  for (int i = 0; i < 5; ++i) {
    const std::string prefix = base + std::to_string(i) + "_";
    if (t.rank() == t.world_size() - 1 && t.rank() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (t.rank() > 0) std::ofstream(prefix + std::to_string(t.rank())) << "entered";
    t.barrier(kLong);
    if (t.rank() == 0) {
      for (int r = 1; r < t.world_size(); ++r) {
        EXPECT_TRUE(std::ifstream(prefix + std::to_string(r)).good()) << "rank " << r << ", barrier " << i;
      }
    }
    t.barrier(kLong);  // rank 0 has looked: the files can go
    if (t.rank() > 0) std::remove((prefix + std::to_string(t.rank())).c_str());
  }
}

TEST(MpiTransport, InvalidArguments) {
  auto& t = transport();
  const int me = t.rank();
  at::Tensor x = at::zeros({2});
  EXPECT_THROW(t.isend(x, {me, 0, "self"}), UsageError);
  EXPECT_THROW(t.isend(x, {t.world_size(), 0, "range"}), UsageError);
  at::Tensor nine = at::zeros(std::vector<int64_t>(9, 1));
  EXPECT_THROW(t.isend(nine, {(me + 1) % t.world_size(), 0, "ndim"}), UsageError);
}

// ---- groups (split) and collectives of any size ----
// gtest runs the MpiTransport suite (whose last test breaks its transport's collectives) first: these tests use
// a transport of their own.

MpiTransport& group_world() {
  static MpiTransport t(*mpitest::g_mpi);
  return t;
}

TEST(MpiTransportGroups, SplitByParityAndByHalf) {
  auto& t = group_world();
  if (t.world_size() != 4) GTEST_SKIP() << "the dp x pp layouts need mpiexec -n 4";
  testing::check_groups(t, testing::GroupLayout::kByParity, kLong);
  testing::check_groups(t, testing::GroupLayout::kByHalf, kLong);
}

TEST(MpiTransportGroups, SingletonGroupsAndBroadcast) {
  auto& t = group_world();
  const int me = t.rank(), n = t.world_size();
  auto alone = t.split(me, 0, kLong);
  ASSERT_NE(alone, nullptr);
  EXPECT_EQ(alone->rank(), 0);
  EXPECT_EQ(alone->world_size(), 1);
  at::Tensor x = at::full({3}, static_cast<float>(me));
  alone->all_reduce_sum(x, kLong);
  EXPECT_TRUE(at::equal(x, at::full({3}, static_cast<float>(me))));
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kBFloat16, at::kBool}) {
    at::Tensor b = at::full({5, 2}, me == n - 1 ? 1 : 0, dtype);
    t.broadcast(b, n - 1, kLong);
    EXPECT_TRUE(at::equal(b, at::full({5, 2}, 1, dtype))) << c10::toString(dtype);
  }
  at::Tensor big = at::ones({1 << 20}, at::kFloat);
  t.all_reduce_sum(big, kLong);
  EXPECT_TRUE(at::equal(big, at::full({1 << 20}, static_cast<float>(n))));
  t.barrier(kLong);
}

TEST(MpiTransportGroups, PeerThatNeverSplitsTimesOut) {
  if (group_world().world_size() != 4) GTEST_SKIP() << "needs mpiexec -n 4";
  {
    MpiTransport fresh(*mpitest::g_mpi);  // its collectives break; the shared transport's must not
    testing::check_split_timeout(fresh, Duration(300));
    if (fresh.rank() == 3) {
      // Late arrival: match the others' abandoned gathering all-reduce, so that no MPI request stays open.
      std::this_thread::sleep_for(500ms);
      at::Tensor rows = at::zeros({4, 2}, at::kLong);
      fresh.all_reduce_sum(rows, kLong);
    }
    group_world().barrier(kLong);
  }
  group_world().barrier(kLong);
}

// ---- reduce-scatter and all-gather (tests/transport/shard_cases.h), on the groups' transport ----

TEST(MpiTransportShards, SizesDtypesAndRoundTrip) {
  auto& t = group_world();
  testing::check_reduce_scatter_all_gather(t, kLong);
  testing::check_round_trip_matches_all_reduce(t, kLong, /*bitwise=*/false);  // MPI's summation order
}

TEST(MpiTransportShards, AsyncFormsAlsoInAGroup) {
  auto& t = group_world();
  EXPECT_TRUE(t.asynchronous_sharded_collectives());
  testing::check_async_shards(t, kLong);
  auto pair = t.split(t.rank() % 2, t.rank(), kLong);
  testing::check_async_shards(*pair, kLong);
}

// The first call of each is compared across the ranks (one small all-reduce): a mismatch is a UsageError on every
// rank, after which the transport stays usable.
TEST(MpiTransportShards, ArgumentErrorsAndFirstCallSizeMismatch) {
  MpiTransport fresh(*mpitest::g_mpi);  // no reduce-scatter or all-gather checked yet
  testing::check_shard_argument_errors(fresh, kLong);  // its valid calls are the first ones: they pass the check
  MpiTransport other(*mpitest::g_mpi);
  EXPECT_TRUE(testing::sharded_size_mismatch(other, kLong, /*gather=*/false)) << "rank " << other.rank();
  EXPECT_TRUE(testing::sharded_size_mismatch(other, kLong, /*gather=*/true)) << "rank " << other.rank();
  at::Tensor x = at::ones({2});
  other.all_reduce_sum(x, kLong);
  EXPECT_TRUE(at::equal(x, at::full({2}, static_cast<float>(other.world_size()))));
}

// Must stay the last test: a timed-out collective permanently breaks this transport's collectives.
TEST(MpiTransport, ZzCollectiveTimeout) {
  auto& t = transport();
  if (t.rank() == 0) {
    try {
      t.barrier(Duration(200));
      ADD_FAILURE() << "expected TimeoutError";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("barrier"), std::string::npos) << e.what();
    }
    at::Tensor x = at::zeros({1});
    EXPECT_THROW(t.all_reduce_sum(x, kLong), TransportError);
  }
  // Rank 0's abandoned barrier is still matched by the others' late arrival, so nobody is left hanging.
  std::this_thread::sleep_for(400ms);
  if (t.rank() != 0) t.barrier(kLong);
}

}  // namespace
}  // namespace twobp
