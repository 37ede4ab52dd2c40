#pragma once
// Transport groups (split) and collectives, written once against the Transport interface: each function runs on
// one rank (a thread of a LocalTransport test, a process of a Store or MPI test) of a 4-rank world.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "twobp/error.h"
#include "twobp/transport/transport.h"

namespace twobp::testing {

/// The dp x pp layouts of 4 ranks: kByParity = color rank % 2 (ranks {0, 2} and {1, 3}), kByHalf = color rank / 2
/// ({0, 1} and {2, 3}). kByHalf orders each group by a descending key, so group rank 0 is the higher world rank.
enum class GroupLayout { kByParity, kByHalf };

inline int group_color(GroupLayout layout, int rank) { return layout == GroupLayout::kByParity ? rank % 2 : rank / 2; }
inline int group_key(GroupLayout layout, int rank) { return layout == GroupLayout::kByParity ? rank : -rank; }

/// World ranks of `color`'s group in group order.
inline std::vector<int> group_members(GroupLayout layout, int world, int color) {
  std::vector<int> members;
  for (int r = 0; r < world; ++r) {
    if (group_color(layout, r) == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return group_key(layout, a) < group_key(layout, b); });
  return members;
}

/// Everything a group must do, on every rank of `world` (4 ranks): ranks, a 1M-element all-reduce, a broadcast
/// from group rank 1, a ring inside the group, the same tag in both groups and the parent at once, and a split
/// in which one rank is in no group.
inline void check_groups(Transport& world, GroupLayout layout, Duration timeout) {
  ASSERT_EQ(world.world_size(), 4);
  const int me = world.rank();
  const int color = group_color(layout, me);
  const auto members = group_members(layout, 4, color);
  const int expected_rank = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());

  std::unique_ptr<Transport> group = world.split(color, group_key(layout, me), timeout);
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->rank(), expected_rank);
  EXPECT_EQ(group->world_size(), 2);
  EXPECT_EQ(group->device(), world.device());
  const int g = group->rank();
  // Tensors live on the transport's device (CPU, or the rank's GPU under NCCL); results are compared on the CPU.
  const c10::Device dev = world.device();

  // All-reduce of a large tensor: the group's sum, not the world's. Values stay exact in float32.
  const std::int64_t n = 1 << 20;
  at::Tensor x = at::arange(n, at::kFloat).mul_(static_cast<float>(me + 1)).to(dev);
  group->all_reduce_sum(x, timeout);
  const float factor = static_cast<float>(members[0] + 1 + members[1] + 1);
  EXPECT_TRUE(at::equal(x.cpu(), at::arange(n, at::kFloat).mul_(factor))) << "rank " << me;
  at::Tensor d = at::full({3, 5}, static_cast<double>(me), at::kDouble).to(dev);
  group->all_reduce_sum(d, timeout);
  EXPECT_TRUE(at::equal(d.cpu(), at::full({3, 5}, static_cast<double>(members[0] + members[1]), at::kDouble)));

  // Broadcast from group rank 1.
  at::Tensor b = at::full({1000}, static_cast<std::int64_t>(me), at::kLong).to(dev);
  group->broadcast(b, 1, timeout);
  EXPECT_TRUE(at::equal(b.cpu(), at::full({1000}, static_cast<std::int64_t>(members[1]), at::kLong))) << "rank " << me;

  // A ring inside the group (group ranks as peers).
  {
    const int next = (g + 1) % 2, prev = (g + 1) % 2;
    at::Tensor out = at::full({4}, static_cast<float>(me)).to(dev);
    at::Tensor in = at::empty({4}, dev);
    auto r = group->irecv(in, {prev, 3, "RECV ring"});
    auto s = group->isend(out, {next, 3, "SEND ring"});
    s->wait(timeout);
    r->wait(timeout);
    EXPECT_TRUE(at::equal(in.cpu(), at::full({4}, static_cast<float>(members[prev]))));
  }

  // The same tag, at the same time, in both groups and in the parent: nothing is mixed up.
  {
    const int other = (g + 1) % 2;
    at::Tensor group_out = at::full({2}, 100.0f * static_cast<float>(color) + static_cast<float>(me)).to(dev);
    at::Tensor group_in = at::empty({2}, dev);
    at::Tensor world_out = at::full({2}, 1000.0f + static_cast<float>(me)).to(dev);
    at::Tensor world_in = at::empty({2}, dev);
    const int wnext = (me + 1) % 4, wprev = (me + 3) % 4;
    auto r1 = world.irecv(world_in, {wprev, 7, "RECV world tag 7"});
    auto r2 = group->irecv(group_in, {other, 7, "RECV group tag 7"});
    auto s1 = group->isend(group_out, {other, 7, "SEND group tag 7"});
    auto s2 = world.isend(world_out, {wnext, 7, "SEND world tag 7"});
    s1->wait(timeout);
    s2->wait(timeout);
    r1->wait(timeout);
    r2->wait(timeout);
    EXPECT_TRUE(at::equal(group_in.cpu(), at::full({2}, 100.0f * static_cast<float>(color) +
                                                       static_cast<float>(members[other]))))
        << "rank " << me;
    EXPECT_TRUE(at::equal(world_in.cpu(), at::full({2}, 1000.0f + static_cast<float>(wprev)))) << "rank " << me;
  }
  group->barrier(timeout);

  // A second split in which rank 3 is in no group: it gets nullptr; the others form a group of 3.
  std::unique_ptr<Transport> three = world.split(me == 3 ? -1 : 0, 0, timeout);
  if (me == 3) {
    EXPECT_EQ(three, nullptr);
  } else {
    ASSERT_NE(three, nullptr);
    EXPECT_EQ(three->world_size(), 3);
    EXPECT_EQ(three->rank(), me);
    at::Tensor y = at::ones({5}, at::kLong).to(dev);
    three->all_reduce_sum(y, timeout);
    EXPECT_TRUE(at::equal(y.cpu(), at::full({5}, 3, at::kLong)));
    // A group of a group.
    std::unique_ptr<Transport> pair = three->split(three->rank() < 2 ? 0 : -1, 0, timeout);
    EXPECT_EQ(pair != nullptr, three->rank() < 2);
    if (pair) {
      at::Tensor z = at::full({1}, static_cast<double>(me), at::kDouble).to(dev);
      pair->broadcast(z, 0, timeout);
      EXPECT_EQ(z.cpu().item<double>(), 0.0);
    }
  }
  // The parent still works after its groups' traffic.
  at::Tensor w = at::ones({1}, at::kLong).to(dev);
  world.all_reduce_sum(w, timeout);
  EXPECT_EQ(w.cpu().item<std::int64_t>(), 4);
}

/// Rank 3 never calls split: the others get an error that says split, timed out and rank 3, within the timeout.
/// Afterwards `world`'s collectives are broken (a timed-out collective cannot be taken back).
inline void check_split_timeout(Transport& world, Duration timeout) {
  if (world.rank() == 3) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    auto group = world.split(world.rank() % 2, 0, timeout);
    ADD_FAILURE() << "expected TimeoutError";
  } catch (const Error& e) {
    // The first rank to give up gets TimeoutError; on transports with a shared collective state (Local) the
    // others are woken at once with a TransportError quoting it.
    EXPECT_TRUE(dynamic_cast<const TimeoutError*>(&e) || dynamic_cast<const TransportError*>(&e)) << e.what();
    const std::string what = e.what();
    for (const char* w : {"split", "color", "timed out", "3"}) {
      EXPECT_NE(what.find(w), std::string::npos) << w << " in " << what;
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, timeout + std::chrono::seconds(5));
}

/// all_reduce_sum_async: several reductions in flight at once (float, double, bfloat16 through float32, and one
/// in a group), waited for in reverse order; each holds its sum afterwards, whatever the transport overlaps.
inline void check_async_all_reduce(Transport& world, Duration timeout) {
  const int n = world.world_size(), me = world.rank();
  at::Tensor f = at::full({1 << 16}, static_cast<float>(me + 1));
  at::Tensor d = at::arange(7, at::kDouble) * (me + 1);
  at::Tensor h = at::full({5}, 0.5, at::kBFloat16);
  std::vector<std::unique_ptr<Work>> works;
  works.push_back(world.all_reduce_sum_async(f, timeout));
  works.push_back(world.all_reduce_sum_async(d, timeout));
  works.push_back(world.all_reduce_sum_async(h, timeout));
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait(timeout);
  const double total = n * (n + 1) / 2.0;
  EXPECT_TRUE(at::equal(f, at::full({1 << 16}, static_cast<float>(total))));
  EXPECT_TRUE(at::equal(d, at::arange(7, at::kDouble) * total));
  EXPECT_TRUE(at::equal(h, at::full({5}, 0.5 * n, at::kBFloat16)));
  // In a group of two (by parity), next to a reduction of the parent started before it.
  auto group = world.split(me % 2, me, timeout);
  at::Tensor w = at::ones({3});
  at::Tensor g = at::full({3}, static_cast<float>(me));
  auto parent_work = world.all_reduce_sum_async(w, timeout);
  auto group_work = group->all_reduce_sum_async(g, timeout);
  group_work->wait(timeout);
  parent_work->wait(timeout);
  float expected = 0;
  for (int r = me % 2; r < n; r += 2) expected += static_cast<float>(r);
  EXPECT_TRUE(at::equal(g, at::full({3}, expected)));
  EXPECT_TRUE(at::equal(w, at::full({3}, static_cast<float>(n))));
}

/// Group rank 0 of color 0 aborts its group: its group peer's pending receive fails with TransportError naming
/// the reason. `reaches_other_groups`: whether the abort also fails the other group (Local: every group split
/// from one world fails together; Store: the other group is unaffected). (Not for MPI, where abort ends the job.)
inline void check_group_abort(Transport& world, Duration timeout, bool reaches_other_groups) {
  const int me = world.rank();
  auto group = world.split(me % 2, me, timeout);
  ASSERT_NE(group, nullptr);
  auto expect_aborted = [&](Transport& t, int peer) {
    at::Tensor in = at::empty({2});
    const auto t0 = std::chrono::steady_clock::now();
    try {
      t.irecv(in, {peer, 1, "RECV_F stage 1 micro-batch 0"})->wait(timeout);
      ADD_FAILURE() << "expected TransportError";
    } catch (const TransportError& e) {
      const std::string what = e.what();
      for (const char* w : {"injected failure in group 0", "aborted", "group color 0"}) {
        EXPECT_NE(what.find(w), std::string::npos) << w << " in " << what;
      }
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, timeout) << "an abort must be seen before the timeout";
  };
  if (me % 2 == 0) {
    if (group->rank() == 0) {
      group->abort("injected failure in group 0");
      return;
    }
    expect_aborted(*group, 0);
  } else if (reaches_other_groups) {
    expect_aborted(*group, 1 - group->rank());  // a message nobody sends: only the abort ends the wait
  } else {
    at::Tensor x = at::ones({4});
    group->all_reduce_sum(x, timeout);
    EXPECT_TRUE(at::equal(x, at::full({4}, 2.0f)));
  }
}

}  // namespace twobp::testing
