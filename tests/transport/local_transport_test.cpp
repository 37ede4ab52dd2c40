// LocalTransport: ranks are threads. These tests also pin the error messages the rest of the library relies on
// (peer, label, shapes in every error).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"
#include "twobp/transport/mpi.h"
#include "transport/group_cases.h"
#include "transport/shard_cases.h"

namespace twobp {
namespace {

using namespace std::chrono_literals;
constexpr Duration kLong{10000};

/// Runs fn(rank, transport) on one thread per rank (twobp::run_rank_threads, without aborting the peers of a rank
/// that throws: some tests let one rank fail on purpose); rethrows the root cause on the calling thread.
void run_ranks(std::vector<std::unique_ptr<Transport>>& ts, const std::function<void(int, Transport&)>& fn) {
  run_rank_threads(ts, [&](Transport& t) { fn(t.rank(), t); }, /*abort_on_error=*/false).rethrow_root_cause();
}

P2POptions op(int peer, std::int64_t tag, std::string label = "") { return P2POptions{peer, tag, std::move(label)}; }

TEST(LocalTransport, Basics) {
  LocalTransportGroup group(3);
  EXPECT_EQ(group.world_size(), 3);
  EXPECT_EQ(group.transport(2).rank(), 2);
  EXPECT_EQ(group.transport(2).world_size(), 3);
  EXPECT_EQ(group.transport(0).device(), c10::Device(c10::kCPU));
  EXPECT_EQ(group.transport(0).name(), "local");
  EXPECT_THROW(group.transport(3), UsageError);
  EXPECT_THROW(LocalTransportGroup(0), UsageError);
}

TEST(LocalTransport, RoundTripSeveralDtypesAndShapes) {
  for (bool sync : {false, true}) {
    auto ts = make_local_transports(2, LocalOptions{sync});
    const std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>> cases = {
        {{4}, c10::kFloat}, {{2, 3}, c10::kDouble}, {{2, 3, 4}, c10::kHalf}, {{5, 1}, c10::kBFloat16},
        {{7}, c10::kLong}, {{3, 3}, c10::kInt},     {{0, 4}, c10::kFloat},  {{}, c10::kFloat},
        {{6}, c10::kBool}};
    auto make = [](const std::vector<int64_t>& shape, c10::ScalarType type, int seed) {
      return at::arange(c10::multiply_integers(shape), at::TensorOptions().dtype(at::kDouble))
          .add(seed)
          .remainder(100)
          .to(type)
          .reshape(shape);
    };
    run_ranks(ts, [&](int rank, Transport& t) {
      for (std::size_t i = 0; i < cases.size(); ++i) {
        const auto& [shape, type] = cases[i];
        if (rank == 0) {
          at::Tensor x = make(shape, type, static_cast<int>(i));
          auto w = t.isend(x, op(1, static_cast<int64_t>(i), "SEND"));
          w->wait(kLong);
          x.fill_(0);  // the receiver must still get the values sent
        } else {
          at::Tensor y = at::empty(shape, at::TensorOptions().dtype(type));
          t.irecv(y, op(0, static_cast<int64_t>(i), "RECV"))->wait(kLong);
          EXPECT_TRUE(at::equal(y, make(shape, type, static_cast<int>(i)))) << "case " << i << " sync " << sync;
        }
      }
    });
  }
}

TEST(LocalTransport, OutOfOrderTags) {
  auto ts = make_local_transports(2);
  run_ranks(ts, [&](int rank, Transport& t) {
    constexpr int n = 16;
    if (rank == 0) {
      std::vector<std::unique_ptr<Work>> works;
      for (int tag = 0; tag < n; ++tag) works.push_back(t.isend(at::full({3}, static_cast<float>(tag)), op(1, tag)));
      for (auto& w : works) w->wait(kLong);
    } else {
      // Post receives in reverse order and wait in a scrambled order.
      std::vector<at::Tensor> bufs(n);
      std::vector<std::unique_ptr<Work>> works(n);
      for (int tag = n - 1; tag >= 0; --tag) {
        bufs[tag] = at::empty({3});
        works[tag] = t.irecv(bufs[tag], op(0, tag));
      }
      for (int i = 0; i < n; ++i) {
        const int tag = (i * 7) % n;
        works[tag]->wait(kLong);
        EXPECT_TRUE(at::equal(bufs[tag], at::full({3}, static_cast<float>(tag)))) << tag;
      }
    }
  });
}

TEST(LocalTransport, SameTagIsFifo) {
  auto ts = make_local_transports(2);
  auto& t0 = *ts[0];
  auto& t1 = *ts[1];
  t0.isend(at::full({1}, 1.0), op(1, 5))->wait(kLong);
  t0.isend(at::full({1}, 2.0), op(1, 5))->wait(kLong);
  at::Tensor a = at::empty({1}), b = at::empty({1});
  t1.irecv(a, op(0, 5))->wait(kLong);
  t1.irecv(b, op(0, 5))->wait(kLong);
  EXPECT_EQ(a.item<float>(), 1.0f);
  EXPECT_EQ(b.item<float>(), 2.0f);
}

TEST(LocalTransport, ShapeMismatchNamesBothRanksLabelAndShapes) {
  auto ts = make_local_transports(2);
  ts[0]->isend(at::zeros({2, 3}), op(1, 0, "SEND_F stage 0 micro-batch 4"))->wait(kLong);
  at::Tensor buf = at::empty({3, 2});
  auto w = ts[1]->irecv(buf, op(0, 0, "RECV_F stage 1 micro-batch 4"));
  try {
    w->wait(kLong);
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("RECV_F stage 1 micro-batch 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[3, 2] Float"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 3] Float"), std::string::npos) << msg;
  }
  // dtype mismatch, via is_completed()
  ts[0]->isend(at::zeros({4}, at::kDouble), op(1, 1))->wait(kLong);
  at::Tensor fbuf = at::empty({4});
  auto w2 = ts[1]->irecv(fbuf, op(0, 1));
  try {
    w2->is_completed();
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("Double"), std::string::npos) << e.what();
  }
}

TEST(LocalTransport, InvalidArguments) {
  auto ts = make_local_transports(2);
  at::Tensor x = at::zeros({2, 2});
  EXPECT_THROW(ts[0]->isend(x, op(0, 0)), UsageError);   // self
  EXPECT_THROW(ts[0]->isend(x, op(2, 0)), UsageError);   // out of range
  EXPECT_THROW(ts[0]->isend(x, op(1, -1)), UsageError);  // negative tag
  EXPECT_THROW(ts[0]->isend(x.t().contiguous().t(), op(1, 0)), UsageError);  // not contiguous
  at::Tensor undefined;
  EXPECT_THROW(ts[1]->irecv(undefined, op(0, 0)), UsageError);
}

TEST(LocalTransport, TimeoutNamesPeerAndLabel) {
  auto ts = make_local_transports(2);
  at::Tensor buf = at::empty({2});
  auto w = ts[1]->irecv(buf, op(0, 0, "RECV_F stage 1 micro-batch 0"));
  EXPECT_FALSE(w->is_completed());
  const auto start = std::chrono::steady_clock::now();
  try {
    w->wait(Duration(200));
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    const auto elapsed = std::chrono::steady_clock::now() - start;
    EXPECT_GE(elapsed, 190ms);
    EXPECT_LT(elapsed, 2000ms);
    EXPECT_EQ(std::string(e.what()),
              "rank 1: timed out after 200 ms waiting for RECV_F stage 1 micro-batch 0 from rank 0");
  }
  w.reset();  // withdraws the posted receive: a later message must go to the next receive
  ts[0]->isend(at::full({2}, 3.0), op(1, 0))->wait(kLong);
  ts[1]->irecv(buf, op(0, 0))->wait(kLong);
  EXPECT_TRUE(at::equal(buf, at::full({2}, 3.0)));
}

TEST(LocalTransport, SynchronousSendTimesOutWithoutReceiver) {
  auto ts = make_local_transports(2, LocalOptions{true});
  auto w = ts[0]->isend(at::zeros({1}), op(1, 9, "SEND_B stage 0 micro-batch 2"));
  EXPECT_FALSE(w->is_completed());
  try {
    w->wait(Duration(50));
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("SEND_B stage 0 micro-batch 2 to rank 1"), std::string::npos) << e.what();
  }
  // Posting the receive completes the send.
  at::Tensor buf = at::empty({1});
  auto r = ts[1]->irecv(buf, op(0, 9));
  EXPECT_TRUE(w->is_completed());
  r->wait(kLong);
}

TEST(LocalTransport, AbortWakesPendingWaitsOnOtherRanks) {
  auto ts = make_local_transports(3);
  std::atomic<int> waiting{0};
  run_ranks(ts, [&](int rank, Transport& t) {
    if (rank == 2) {
      while (waiting.load() < 2) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(20ms);  // let them block in wait()
      t.abort("loss is NaN");
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      if (rank == 0) {
        at::Tensor buf = at::empty({1});
        auto w = t.irecv(buf, op(1, 0, "RECV_F stage 0 micro-batch 0"));
        waiting++;
        w->wait(kLong);
      } else {
        waiting++;
        t.barrier(kLong);
      }
      ADD_FAILURE() << "rank " << rank << ": expected TransportError";
    } catch (const TransportError& e) {
      const std::string msg = e.what();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 5000ms);
      EXPECT_NE(msg.find("rank 2 aborted: loss is NaN"), std::string::npos) << msg;
      EXPECT_EQ(msg.rfind("rank " + std::to_string(rank) + ":", 0), 0u) << msg;
    }
    // Future operations fail too.
    at::Tensor x = at::zeros({1});
    EXPECT_THROW(t.isend(x, op(rank == 0 ? 1 : 0, 1)), TransportError);
    EXPECT_THROW(t.all_reduce_sum(x, kLong), TransportError);
  });
}

TEST(LocalTransport, AllReduceSum) {
  auto ts = make_local_transports(4);
  run_ranks(ts, [&](int rank, Transport& t) {
    for (int round = 0; round < 20; ++round) {
      at::Tensor x = at::full({3}, static_cast<double>(rank + round), at::kDouble);
      t.all_reduce_sum(x, kLong);
      EXPECT_TRUE(at::equal(x, at::full({3}, 6.0 + 4 * round, at::kDouble))) << round;
      at::Tensor h = at::full({2}, 1.5, at::kHalf);
      t.all_reduce_sum(h, kLong);
      EXPECT_TRUE(at::equal(h, at::full({2}, 6.0, at::kHalf)));
    }
  });
}

TEST(LocalTransport, BarrierWaitsForEveryone) {
  auto ts = make_local_transports(3);
  std::atomic<int> arrived{0};
  run_ranks(ts, [&](int rank, Transport& t) {
    if (rank == 1) std::this_thread::sleep_for(50ms);
    arrived++;
    t.barrier(kLong);
    EXPECT_EQ(arrived.load(), 3);
    t.barrier(kLong);
  });
}

TEST(LocalTransport, CollectiveTimeoutAndMismatch) {
  {
    auto ts = make_local_transports(3);
    try {
      ts[0]->barrier(Duration(50));
      FAIL() << "expected TimeoutError";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("waiting for rank(s) 1, 2"), std::string::npos) << e.what();
    }
    // The collective sequence is now broken for everyone.
    EXPECT_THROW(ts[1]->barrier(kLong), TransportError);
  }
  // Mismatched collectives: the rank that arrives second finds the mismatch (UsageError), the first learns that
  // the sequence broke (TransportError). Which one arrives first is up to the scheduler (the sleep only makes rank
  // 1 first usually), so the pair of errors is checked, not who got which.
  auto thrown_by = [](const std::function<void()>& call) -> std::string {
    try {
      call();
    } catch (const UsageError&) {
      return "usage";
    } catch (const TransportError&) {
      return "transport";
    } catch (const std::exception& e) {
      return std::string("other: ") + e.what();
    }
    return "none";
  };
  for (bool same_kind : {false, true}) {  // an all-reduce against a barrier; all-reduces of other shapes
    SCOPED_TRACE(same_kind ? "all-reduces of 2 and 3 elements" : "all-reduce against barrier");
    auto ts = make_local_transports(2);
    std::string first;
    std::thread other([&] {
      at::Tensor x = at::zeros({2});
      first = thrown_by([&] { ts[1]->all_reduce_sum(x, kLong); });
    });
    std::this_thread::sleep_for(20ms);
    at::Tensor y = at::zeros({3});
    const std::string second =
        thrown_by([&] { same_kind ? ts[0]->all_reduce_sum(y, kLong) : ts[0]->barrier(kLong); });
    other.join();
    EXPECT_TRUE((first == "transport" && second == "usage") || (first == "usage" && second == "transport"))
        << "rank 1: " << first << ", rank 0: " << second;
  }
}

TEST(LocalTransport, ManyThreadsPingPong) {
  // A ring under load, for ThreadSanitizer builds: each rank sends to next and receives from previous.
  auto ts = make_local_transports(4, LocalOptions{true});
  run_ranks(ts, [&](int rank, Transport& t) {
    const int next = (rank + 1) % 4, prev = (rank + 3) % 4;
    for (int i = 0; i < 200; ++i) {
      at::Tensor buf = at::empty({8});
      auto r = t.irecv(buf, op(prev, i));
      auto s = t.isend(at::full({8}, static_cast<float>(rank * 1000 + i)), op(next, i));
      r->wait(kLong);
      s->wait(kLong);
      ASSERT_EQ(buf[0].item<float>(), static_cast<float>(prev * 1000 + i));
    }
    at::Tensor total = at::ones({1});
    t.all_reduce_sum(total, kLong);
    EXPECT_EQ(total.item<float>(), 4.0f);
  });
}

// In-order pairing (LocalOptions::pairing = kInOrderPerChannel) behaves like NCCL: messages are matched in posting
// order per (src, dst, channel), whatever their tags; channels are independent.
P2POptions on_channel(int peer, std::int64_t tag, int channel, std::string label) {
  P2POptions o{peer, tag, std::move(label)};
  o.channel = channel;
  return o;
}

TEST(LocalTransportInOrder, MatchesInPostingOrderPerChannel) {
  LocalOptions options;
  options.pairing = Pairing::kInOrderPerChannel;
  auto ts = make_local_transports(2, options);
  EXPECT_EQ(ts[0]->name(), "local-in-order");
  EXPECT_EQ(ts[0]->pairing(), Pairing::kInOrderPerChannel);
  run_ranks(ts, [](int rank, Transport& t) {
    if (rank == 0) {
      // Channel 1 first, then channel 0: the receiver posts channel 0 first; separate channels do not interfere.
      for (int k = 0; k < 3; ++k) t.isend(at::full({2}, 10.0 + k), on_channel(1, 100 + k, 1, "grad"))->wait(kLong);
      for (int k = 0; k < 3; ++k) t.isend(at::full({2}, 1.0 + k), on_channel(1, k, 0, "act"))->wait(kLong);
    } else {
      std::vector<at::Tensor> in(6);
      std::vector<std::unique_ptr<Work>> works;
      for (int k = 0; k < 3; ++k) {
        in[k] = at::empty({2});
        works.push_back(t.irecv(in[k], on_channel(0, k, 0, "act")));
      }
      for (int k = 0; k < 3; ++k) {
        in[3 + k] = at::empty({2});
        works.push_back(t.irecv(in[3 + k], on_channel(0, 100 + k, 1, "grad")));
      }
      for (auto& w : works) w->wait(kLong);
      for (int k = 0; k < 3; ++k) {
        EXPECT_EQ(in[k][0].item<float>(), 1.0f + k);
        EXPECT_EQ(in[3 + k][0].item<float>(), 10.0f + k);
      }
    }
  });
}

TEST(LocalTransportInOrder, DifferentPostingOrdersAreReportedNotSwapped) {
  LocalOptions options;
  options.pairing = Pairing::kInOrderPerChannel;
  auto ts = make_local_transports(2, options);
  // By tag these would pair fine; in order, the first receive (tag 2) meets the first send (tag 1).
  at::Tensor a = at::full({3}, 1.0), b = at::full({3}, 2.0);
  ts[0]->isend(a, on_channel(1, 1, 0, "SEND_F stage 0 micro-batch 0"));
  ts[0]->isend(b, on_channel(1, 2, 0, "SEND_F stage 0 micro-batch 1"));
  at::Tensor in = at::empty({3});
  auto r = ts[1]->irecv(in, on_channel(0, 2, 0, "RECV_F stage 1 micro-batch 1"));
  try {
    r->wait(kLong);
    ADD_FAILURE() << "expected UsageError";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    for (const char* word : {"RECV_F stage 1 micro-batch 1", "SEND_F stage 0 micro-batch 0", "in-order pairing",
                             "channel 0", "tag 1", "expected tag 2"}) {
      EXPECT_NE(what.find(word), std::string::npos) << "'" << word << "' not in: " << what;
    }
  }
  // The same traffic is fine by tag.
  auto by_tag = make_local_transports(2);
  by_tag[0]->isend(a, on_channel(1, 1, 0, "s1"));
  by_tag[0]->isend(b, on_channel(1, 2, 0, "s2"));
  by_tag[1]->irecv(in, on_channel(0, 2, 0, "r2"))->wait(kLong);
  EXPECT_TRUE(at::equal(in, b));
}


// ---- groups (split) and collectives of any size ----

TEST(LocalTransportGroups, SplitByParityAndByHalf) {
  for (auto layout : {testing::GroupLayout::kByParity, testing::GroupLayout::kByHalf}) {
    for (auto pairing : {Pairing::kByTag, Pairing::kInOrderPerChannel}) {
      LocalOptions options;
      options.pairing = pairing;
      auto ts = make_local_transports(4, options);
      run_ranks(ts, [&](int, Transport& t) { testing::check_groups(t, layout, kLong); });
    }
  }
}

TEST(LocalTransportGroups, AsynchronousAllReduces) {
  auto ts = make_local_transports(4);
  run_ranks(ts, [&](int, Transport& t) { testing::check_async_all_reduce(t, kLong); });
}

TEST(LocalTransportGroups, PeerThatNeverSplitsTimesOut) {
  auto ts = make_local_transports(4);
  run_ranks(ts, [&](int, Transport& t) { testing::check_split_timeout(t, Duration(300)); });
}

TEST(LocalTransportGroups, AbortInAGroupFailsEveryGroupOfTheWorld) {
  auto ts = make_local_transports(4);
  run_ranks(ts, [&](int, Transport& t) { testing::check_group_abort(t, kLong, /*reaches_other_groups=*/true); });
}

TEST(LocalTransportGroups, ErrorsNameGroupRankColorAndParentRank) {
  auto ts = make_local_transports(4);
  run_ranks(ts, [&](int r, Transport& t) {
    auto g = t.split(r / 2, r, kLong);
    if (r == 3) {
      at::Tensor in = at::empty({1});
      try {
        g->irecv(in, {0, 5, "RECV_F stage 1 micro-batch 2"})->wait(Duration(50));
        ADD_FAILURE() << "expected TimeoutError";
      } catch (const TimeoutError& e) {
        const std::string what = e.what();
        for (const char* w : {"rank 1 (group color 1, rank 3 in the parent)", "RECV_F stage 1 micro-batch 2",
                              "from rank 0"}) {
          EXPECT_NE(what.find(w), std::string::npos) << w << " in " << what;
        }
      }
    }
  });
}

TEST(LocalTransportCollectives, BroadcastAndLargeAllReduce) {
  auto ts = make_local_transports(3);
  run_ranks(ts, [&](int r, Transport& t) {
    for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kBFloat16}) {
      at::Tensor x = at::full({7, 3}, r + 1, dtype);
      t.broadcast(x, 2, kLong);
      EXPECT_TRUE(at::equal(x, at::full({7, 3}, 3, dtype)));
    }
    at::Tensor big = at::ones({3 << 20}, at::kFloat);
    t.all_reduce_sum(big, kLong);
    EXPECT_TRUE(at::equal(big, at::full({3 << 20}, 3.0f)));
    // Disagreeing about the root is the "same order" UsageError, not a silent wrong result.
    at::Tensor y = at::zeros({2});
    try {
      t.broadcast(y, r == 0 ? 1 : 0, Duration(2000));
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("broadcast from rank"), std::string::npos) << e.what();
    }
    EXPECT_THROW(t.broadcast(y, 3, kLong), UsageError);
  });
}

// ---- reduce-scatter and all-gather (tests/transport/shard_cases.h) ----

TEST(ShardRange, OneContiguousLayoutInRankOrder) {
  EXPECT_EQ(shard_range(10, 4, 0), (ShardRange{0, 3}));
  EXPECT_EQ(shard_range(10, 4, 1), (ShardRange{3, 6}));
  EXPECT_EQ(shard_range(10, 4, 2), (ShardRange{6, 8}));
  EXPECT_EQ(shard_range(10, 4, 3), (ShardRange{8, 10}));
  EXPECT_EQ(shard_range(2, 4, 3), (ShardRange{2, 2}));  // fewer elements than ranks: empty shards at the end
  EXPECT_EQ(shard_range(0, 3, 1).size(), 0);
  for (int world = 1; world <= 6; ++world) {
    for (std::int64_t n = 0; n <= 20; ++n) {
      std::int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const ShardRange s = shard_range(n, world, r);
        EXPECT_EQ(s.begin, next) << n << " over " << world << ", rank " << r;
        EXPECT_EQ(s.size(), n / world + (r < n % world ? 1 : 0)) << n << " over " << world << ", rank " << r;
        next = s.end;
      }
      EXPECT_EQ(next, n);
    }
  }
  EXPECT_THROW(shard_range(-1, 2, 0), UsageError);
  EXPECT_THROW(shard_range(4, 0, 0), UsageError);
  EXPECT_THROW(shard_range(4, 2, 2), UsageError);
}

TEST(LocalTransportShards, SizesDtypesAndRoundTripOverOneToFourRanks) {
  for (int world = 1; world <= 4; ++world) {
    auto ts = make_local_transports(world);
    run_ranks(ts, [&](int, Transport& t) {
      testing::check_reduce_scatter_all_gather(t, kLong);
      testing::check_round_trip_matches_all_reduce(t, kLong, /*bitwise=*/true);
    });
  }
}

TEST(LocalTransportShards, AsyncForms) {
  auto ts = make_local_transports(4);
  EXPECT_FALSE(ts[0]->asynchronous_sharded_collectives());
  run_ranks(ts, [&](int, Transport& t) { testing::check_async_shards(t, kLong); });
}

// In the groups of ParallelGroups (world-named wrappers of split groups: WrappingTransport's forwarding) and in a
// plain split group.
TEST(LocalTransportShards, InGroups) {
  auto ts = make_local_transports(4);
  run_ranks(ts, [&](int r, Transport& t) {
    ParallelGroups groups(t, 2, kLong);
    testing::check_async_shards(*groups.data_parallel(), kLong);
    testing::check_async_shards(groups.pipeline(), kLong);
    auto three = t.split(r == 0 ? -1 : 0, 0, kLong);
    if (three) testing::check_round_trip_matches_all_reduce(*three, kLong, /*bitwise=*/true);
  });
}

TEST(LocalTransportShards, ArgumentErrorsAndSizeMismatches) {
  auto ts = make_local_transports(3);
  run_ranks(ts, [&](int, Transport& t) { testing::check_shard_argument_errors(t, kLong); });
  for (bool gather : {false, true}) {
    SCOPED_TRACE(gather ? "all_gather" : "reduce_scatter_sum");
    auto fresh = make_local_transports(4);  // a mismatch breaks the group's collectives
    std::atomic<int> usage{0};
    run_ranks(fresh, [&](int, Transport& t) { usage += testing::sharded_size_mismatch(t, kLong, gather) ? 1 : 0; });
    EXPECT_GE(usage.load(), 1) << "the rank that found the mismatch raises UsageError";
  }
}

// A Transport written against 0.2: the pure virtuals of that release only, forwarding to a Local rank. It compiles
// unchanged, and the base class's defaults give it the sharded collectives (all_reduce_sum then its shard; one
// broadcast per rank).
class TransportOf02 final : public Transport {
 public:
  explicit TransportOf02(Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  c10::Device device() const override { return inner_.device(); }
  std::string name() const override { return "written for 0.2"; }
  Pairing pairing() const override { return inner_.pairing(); }
  std::unique_ptr<Work> isend(const at::Tensor& t, const P2POptions& o) override { return inner_.isend(t, o); }
  std::unique_ptr<Work> irecv(at::Tensor& t, const P2POptions& o) override { return inner_.irecv(t, o); }
  void all_reduce_sum(at::Tensor& t, Duration timeout) override { inner_.all_reduce_sum(t, timeout); }
  void broadcast(at::Tensor& t, int root, Duration timeout) override { inner_.broadcast(t, root, timeout); }
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override {
    return inner_.split(color, key, timeout);
  }
  void barrier(Duration timeout) override { inner_.barrier(timeout); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  Transport& inner_;
};

TEST(LocalTransportShards, DefaultsOfATransportWrittenFor02) {
  for (int world : {1, 3, 4}) {
    auto ts = make_local_transports(world);
    run_ranks(ts, [&](int, Transport& inner) {
      TransportOf02 t(inner);
      EXPECT_FALSE(t.asynchronous_sharded_collectives());
      testing::check_reduce_scatter_all_gather(t, kLong);
      testing::check_round_trip_matches_all_reduce(t, kLong, /*bitwise=*/true);
      testing::check_async_shards(t, kLong);
      testing::check_shard_argument_errors(t, kLong);
    });
  }
}

// dp 2 x pp 2 on rank threads: one step, then each rank reduce-scatters a flat buffer over its data-parallel group
// as a wait of the job (Pipeline::run_collective) -- except world rank 3 (replica 1, pipeline rank 1), whose caller
// is busy past the timeout. Its replica peer, world rank 1, times out; its error carries the job-wide hang report,
// which names world rank 3 (group rank 1 of that data-parallel group) as the rank that has not joined.
TEST(LocalTransportShards, AReplicaThatNeverReduceScattersIsNamedByWorldRankInTheHangReport) {
  using namespace testing;
  Float64Default float64;
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;  // by world rank, built before the rank threads
  for (int r = 0; r < 4; ++r) chunks.push_back(make_chunk(r % 2));
  const at::Tensor inputs = at::randn({2 * kMicroBatchSize, kDim}), targets = at::randn({2 * kMicroBatchSize, kDim});
  const Duration timeout{800};
  auto ts = make_local_transports(4);
  const RankErrors errors = run_rank_threads(ts, [&](Transport& t) {
    ParallelGroups groups(t, 2, kLong);
    const int stage = groups.pipeline_rank();
    auto& chunk = chunks[static_cast<std::size_t>(t.rank())];
    PipelineOptions o = fixture_options();
    o.executor.timeout = timeout;
    o.data_parallel.group = groups.data_parallel();
    Pipeline p(schedule, {{stage, chunk, [raw = chunk.get(), stage](const at::Tensor& x) {
                             return run_chunk(*raw, stage, x);
                           }}},
               groups.pipeline(), o);
    p.step(inputs, targets);
    if (t.rank() == 3) {
      std::this_thread::sleep_for(2 * timeout);  // busy elsewhere: never joins
      return;
    }
    Transport& dp = *groups.data_parallel();
    const at::Tensor flat = at::ones({7});
    at::Tensor shard = at::empty({shard_range(7, dp.world_size(), dp.rank()).size()}, flat.options());
    p.run_collective(dp, "the ZeRO-2 gradient reduce-scatter", [&] { dp.reduce_scatter_sum(flat, shard, timeout); });
  }, /*abort_on_error=*/false);
  EXPECT_FALSE(errors.errors[0]) << error_message(errors.errors[0]);  // its replica group {0, 2} completed
  EXPECT_FALSE(errors.errors[2]) << error_message(errors.errors[2]);
  EXPECT_FALSE(errors.errors[3]) << error_message(errors.errors[3]);
  ASSERT_TRUE(errors.errors[1]);
  const std::string what = error_message(errors.errors[1]);
  const auto at = what.find("hang report (");
  ASSERT_NE(at, std::string::npos) << what;
  const std::string report = what.substr(at);
  const std::string verdict = report.substr(0, report.find('\n'));
  EXPECT_NE(report.find(", 4 ranks): "), std::string::npos) << report;
  EXPECT_NE(verdict.find("rank 3 finished its part of run 0"), std::string::npos) << report;
  EXPECT_NE(verdict.find("has not joined the ZeRO-2 gradient reduce-scatter"), std::string::npos) << report;
  EXPECT_NE(report.find("rank 1: waiting"), std::string::npos) << report;
  EXPECT_NE(report.find("for the ZeRO-2 gradient reduce-scatter with ranks 3 (run 0)"), std::string::npos) << report;
  EXPECT_NE(what.find("reduce_scatter_sum"), std::string::npos) << what;  // the transport's own error names the wait
}

}  // namespace
}  // namespace twobp
