#pragma once
// reduce_scatter_sum and all_gather (ZeRO-2's sharded collectives), written once against the Transport interface:
// each function runs on one rank (a thread of a Local test, a process of a Store, MPI or NCCL test) of any world.
// Tensors live on the transport's device; results are compared on the CPU.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "twobp/error.h"
#include "twobp/transport/transport.h"

namespace twobp::testing {

/// Sizes that exercise the layout over `world` ranks: 0, fewer elements than ranks (empty shards), not divisible by
/// the world, divisible, and a few thousand.
inline std::vector<std::int64_t> shard_test_sizes(int world) {
  return {0, 1, world - 1, world + 1, 3 * world, 7 * world + 3, 4099};
}

/// Rank `rank`'s input of n elements: small integers, so that every sum is exact in every dtype tested (bfloat16
/// included) whatever order a transport adds in.
inline at::Tensor shard_test_input(std::int64_t n, int rank, c10::ScalarType dtype) {
  return at::arange(n, at::kLong).remainder(13).add(rank).to(dtype);
}

/// For every size of shard_test_sizes and float32 / float64 / bfloat16 / int64: reduce_scatter_sum gives this rank
/// the shard (shard_range) of the sum over the ranks, all_gather of those shards gives every rank the whole sum,
/// and that equals all_reduce_sum of the same inputs.
inline void check_reduce_scatter_all_gather(Transport& t, Duration timeout) {
  const int world = t.world_size(), me = t.rank();
  const auto on = at::TensorOptions().device(t.device());
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
    for (std::int64_t n : shard_test_sizes(world)) {
      SCOPED_TRACE("rank " + std::to_string(me) + ", n = " + std::to_string(n) + ", " + c10::toString(dtype));
      at::Tensor expected = at::zeros({n}, at::kLong);
      for (int r = 0; r < world; ++r) expected += shard_test_input(n, r, at::kLong);
      expected = expected.to(dtype);
      const ShardRange mine = shard_range(n, world, me);
      const at::Tensor input = shard_test_input(n, me, dtype).to(t.device());
      at::Tensor shard = at::full({mine.size()}, -1, on.dtype(dtype));
      t.reduce_scatter_sum(input, shard, timeout);
      EXPECT_TRUE(at::equal(shard.cpu(), expected.narrow(0, mine.begin, mine.size())));
      at::Tensor gathered = at::full({n}, -1, on.dtype(dtype));
      t.all_gather(shard, gathered, timeout);
      EXPECT_TRUE(at::equal(gathered.cpu(), expected));
      at::Tensor reduced = input.clone();
      t.all_reduce_sum(reduced, timeout);
      EXPECT_TRUE(at::equal(gathered.cpu(), reduced.cpu()));
      EXPECT_TRUE(at::equal(input.cpu(), shard_test_input(n, me, dtype))) << "the input must stay the caller's";
    }
  }
}

/// Random float32 inputs (seeded by rank): reduce_scatter_sum then all_gather equals all_reduce_sum bitwise, as the
/// Local and Store transports promise (they add in rank order); elsewhere within float32 rounding.
inline void check_round_trip_matches_all_reduce(Transport& t, Duration timeout, bool bitwise) {
  const int world = t.world_size(), me = t.rank();
  const std::int64_t n = 1000 * world + 1;
  at::Tensor input = at::randn({n}, at::TensorOptions().dtype(at::kFloat))
                         .mul_(static_cast<float>(me + 1))
                         .add_(static_cast<float>(me) * 0.25f)
                         .to(t.device());
  at::Tensor shard = at::empty({shard_range(n, world, me).size()}, input.options());
  at::Tensor gathered = at::empty({n}, input.options());
  t.reduce_scatter_sum(input, shard, timeout);
  t.all_gather(shard, gathered, timeout);
  at::Tensor reduced = input.clone();
  t.all_reduce_sum(reduced, timeout);
  if (bitwise) {
    EXPECT_TRUE(at::equal(gathered.cpu(), reduced.cpu())) << "rank " << me;
  } else {
    EXPECT_TRUE(at::allclose(gathered.cpu(), reduced.cpu(), 1e-5, 1e-5)) << "rank " << me;
  }
}

/// The async forms: three in flight at once (a float32 and a bfloat16 reduce-scatter, an int64 all-gather), waited
/// for in reverse order, then one polled with is_completed() until it completes. Each holds its result afterwards,
/// whatever the transport overlaps.
inline void check_async_shards(Transport& t, Duration timeout) {
  const int world = t.world_size(), me = t.rank();
  const std::int64_t n = 5 * world + 2;
  const ShardRange mine = shard_range(n, world, me);
  at::Tensor expected = at::zeros({n}, at::kLong);
  for (int r = 0; r < world; ++r) expected += shard_test_input(n, r, at::kLong);
  const at::Tensor f_in = shard_test_input(n, me, at::kFloat).to(t.device());
  const at::Tensor h_in = shard_test_input(n, me, at::kBFloat16).to(t.device());
  const at::Tensor l_shard = expected.narrow(0, mine.begin, mine.size()).clone().to(t.device());
  at::Tensor f_out = at::empty({mine.size()}, f_in.options());
  at::Tensor h_out = at::empty({mine.size()}, h_in.options());
  at::Tensor l_out = at::empty({n}, l_shard.options());
  std::vector<std::unique_ptr<Work>> works;
  works.push_back(t.reduce_scatter_sum_async(f_in, f_out, timeout));
  works.push_back(t.reduce_scatter_sum_async(h_in, h_out, timeout));
  works.push_back(t.all_gather_async(l_shard, l_out, timeout));
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait(timeout);
  const at::Tensor want = expected.narrow(0, mine.begin, mine.size());
  EXPECT_TRUE(at::equal(f_out.cpu(), want.to(at::kFloat))) << "rank " << me;
  EXPECT_TRUE(at::equal(h_out.cpu(), want.to(at::kBFloat16))) << "rank " << me;
  EXPECT_TRUE(at::equal(l_out.cpu(), expected)) << "rank " << me;

  at::Tensor polled = at::empty({n}, f_in.options());
  at::Tensor f_shard = f_out.clone();
  auto work = t.all_gather_async(f_shard, polled, timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!work->is_completed()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "rank " << me << ": never completed";
    std::this_thread::yield();
  }
  EXPECT_TRUE(at::equal(polled.cpu(), expected.to(at::kFloat))) << "rank " << me;
}

/// What one rank passes wrongly is refused on that rank before anything is sent (the collectives stay in step):
/// an output of the wrong size or dtype, a non-contiguous or 2-D input, a shard of another rank's size. Each error
/// names the rank and what was expected.
inline void check_shard_argument_errors(Transport& t, Duration timeout) {
  const int world = t.world_size(), me = t.rank();
  const auto on = at::TensorOptions().device(t.device());
  const std::int64_t n = 3 * world + 1;
  const ShardRange mine = shard_range(n, world, me);
  const at::Tensor input = at::ones({n}, on);
  auto expect_usage = [&](const std::function<void()>& call, const std::vector<std::string>& words) {
    try {
      call();
      ADD_FAILURE() << "rank " << me << ": expected UsageError naming " << words.front();
    } catch (const UsageError& e) {
      const std::string what = e.what();
      for (const auto& w : words) EXPECT_NE(what.find(w), std::string::npos) << w << " in " << what;
    }
  };
  const std::string shard_size = "[" + std::to_string(mine.size()) + "] Float";
  at::Tensor too_big = at::empty({mine.size() + 1}, on);
  expect_usage([&] { t.reduce_scatter_sum(input, too_big, timeout); },
               {"rank " + std::to_string(me), "reduce_scatter_sum", "expected " + shard_size});
  at::Tensor wrong_dtype = at::empty({mine.size()}, on.dtype(at::kDouble));
  expect_usage([&] { t.reduce_scatter_sum(input, wrong_dtype, timeout); }, {"expected " + shard_size, "Double"});
  at::Tensor out = at::empty({mine.size()}, on);
  const at::Tensor strided = at::ones({2 * n}, on).slice(0, 0, 2 * n, 2);
  expect_usage([&] { t.reduce_scatter_sum(strided, out, timeout); }, {"flat (1-D) contiguous", "not contiguous"});
  expect_usage([&] { t.reduce_scatter_sum(input.view({1, n}), out, timeout); }, {"flat (1-D) contiguous"});
  at::Tensor whole = at::empty({n}, on);
  at::Tensor wrong_shard = at::empty({mine.size() + 1}, on);
  expect_usage([&] { t.all_gather(wrong_shard, whole, timeout); },
               {"all_gather", "shard", "expected " + shard_size});
  // Still in step: a correct pair of collectives afterwards.
  t.reduce_scatter_sum(input, out, timeout);
  t.all_gather(out, whole, timeout);
  EXPECT_TRUE(at::equal(whole.cpu(), at::full({n}, static_cast<float>(world))));
}

/// Rank 1 passes one element more than the other ranks to a reduce-scatter (`gather` false: its input) or an
/// all-gather (`gather` true: its output). Returns whether this rank got a UsageError naming both sizes and rank 1;
/// any other error must be a TransportError quoting the mismatch (a Local rank already waiting in the collective
/// when the mismatch broke it).
inline bool sharded_size_mismatch(Transport& t, Duration timeout, bool gather) {
  const int world = t.world_size(), me = t.rank();
  const std::int64_t n = 2 * world + 1 + (me == 1 ? 1 : 0);
  const auto on = at::TensorOptions().device(t.device());
  at::Tensor whole = at::ones({n}, on);
  at::Tensor shard = at::ones({shard_range(n, world, me).size()}, on);
  try {
    if (gather) {
      t.all_gather(shard, whole, timeout);
    } else {
      t.reduce_scatter_sum(whole, shard, timeout);
    }
    ADD_FAILURE() << "rank " << me << ": a size mismatch between ranks went through";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    const std::string a = "[" + std::to_string(2 * world + 1) + "]", b = "[" + std::to_string(2 * world + 2) + "]";
    for (const std::string& w : {a, b, std::string("rank 1"), std::string(gather ? "all_gather" : "reduce_scatter")}) {
      EXPECT_NE(what.find(w), std::string::npos) << w << " in " << what;
    }
    return true;
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("does not match"), std::string::npos) << e.what();
  }
  return false;
}

}  // namespace twobp::testing
