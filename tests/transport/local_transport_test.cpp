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

#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/local.h"
#include "twobp/transport/mpi.h"
#include "transport/group_cases.h"

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

}  // namespace
}  // namespace twobp
