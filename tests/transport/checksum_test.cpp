// Per-message checksums (twobp/transport/checksum.h): the sum changes with any one flipped bit of any dtype and
// size, messages pass through unchanged, and a corrupted one is refused naming the message and both ranks.
#include "twobp/transport/checksum.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/fault_injection.h"
#include "twobp/transport/local.h"
#include "transport/shard_cases.h"

namespace twobp {
namespace {

const Duration kWait{5000};

TEST(MessageChecksum, EveryFlippedBitChangesIt) {
  torch::manual_seed(5);
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong, at::kInt, at::kByte, at::kBool}) {
    for (int64_t n : {1, 3, 7, 64, 1001}) {  // sizes whose bytes are and are not a multiple of 4
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " x " + std::to_string(n));
      at::Tensor t = dtype == at::kBool ? torch::rand({n}) > 0.5 : (torch::randn({n}) * 100).to(dtype);
      const int64_t before = message_checksum(t).item<int64_t>();
      const at::Tensor bytes = t.view({-1}).view(at::kByte);
      for (int64_t at_byte : {int64_t{0}, bytes.numel() / 2, bytes.numel() - 1}) {
        for (int bit : {0, 3, 7}) {
          if (dtype == at::kBool && bit != 0) continue;  // a bool holds 0 or 1
          bytes.narrow(0, at_byte, 1).bitwise_xor_(1 << bit);
          EXPECT_NE(message_checksum(t).item<int64_t>(), before) << "byte " << at_byte << " bit " << bit;
          bytes.narrow(0, at_byte, 1).bitwise_xor_(1 << bit);
        }
      }
      EXPECT_EQ(message_checksum(t).item<int64_t>(), before);
      // Views and non-contiguous tensors: the bytes of their values.
      EXPECT_EQ(message_checksum(t.unsqueeze(0).expand({2, n}).select(0, 1)).item<int64_t>(), before);
    }
  }
  EXPECT_EQ(message_checksum(at::empty({0})).item<int64_t>(), 0);
}

// Two ranks over Local (both pairing rules): messages pass through verified; a corrupted one is refused.
void exchange(Pairing pairing, bool corrupt) {
  LocalOptions local;
  local.pairing = pairing;
  auto locals = make_local_transports(2, local);
  std::vector<std::shared_ptr<Transport>> transports;
  for (auto& t : locals) {
    std::shared_ptr<Transport> inner(std::move(t));
    if (corrupt && inner->rank() == 0) {
      FaultOptions f;
      f.fault = Fault::kCorrupt;
      f.label_contains = "second";
      inner = std::make_shared<FaultInjectingTransport>(inner, f);
    }
    transports.push_back(std::make_shared<ChecksummingTransport>(inner));
  }
  std::vector<Transport*> raw;
  for (auto& t : transports) raw.push_back(t.get());
  const at::Tensor first = torch::arange(12, at::kFloat), second = torch::randn({3, 5}, at::kDouble);
  std::string error;
  const RankErrors errors = run_rank_threads(raw, [&](Transport& t) {
    if (t.rank() == 0) {
      auto a = t.isend(first, {1, 7, "SEND first", 0});
      auto b = t.isend(second, {1, 8, "SEND second", 0});
      a->wait(kWait);
      b->wait(kWait);
      return;
    }
    at::Tensor x = at::empty({12}, at::kFloat), y = at::empty({3, 5}, at::kDouble);
    auto a = t.irecv(x, {0, 7, "RECV first", 0});
    auto b = t.irecv(y, {0, 8, "RECV second", 0});
    a->wait(kWait);
    EXPECT_TRUE(at::equal(x, first));
    try {
      b->wait(kWait);
      EXPECT_FALSE(corrupt) << "a corrupted message was accepted";
      EXPECT_TRUE(at::equal(y, second));
    } catch (const TransportError& e) {
      error = e.what();
    }
  });
  EXPECT_FALSE(errors.root_cause()) << error_message(errors.root_cause());
  if (corrupt) {
    for (const char* w : {"rank 1: RECV second from rank 0", "checksum mismatch", "corrupted in transit"}) {
      EXPECT_NE(error.find(w), std::string::npos) << w << " not in: " << error;
    }
  }
}

TEST(ChecksummingTransport, PassesMessagesAndRefusesCorruptedOnes) {
  for (Pairing pairing : {Pairing::kByTag, Pairing::kInOrderPerChannel}) {
    exchange(pairing, /*corrupt=*/false);
    exchange(pairing, /*corrupt=*/true);
  }
}

TEST(ChecksummingTransport, TagsOutsideItsRangeAreRefused) {
  auto locals = make_local_transports(2);
  ChecksummingTransport t(std::shared_ptr<Transport>(std::move(locals[0])));
  EXPECT_THROW(t.isend(torch::ones({2}), {1, int64_t{1} << 61, "SEND", 0}), UsageError);
  EXPECT_THROW(t.isend(torch::ones({2}), {1, -1, "SEND", 0}), UsageError);
}

// Collectives pass through unverified (no checksum message): reduce_scatter_sum and all_gather give their exact
// results through the wrapper, in groups split from it too.
TEST(ChecksummingTransport, ShardedCollectivesPassThrough) {
  auto locals = make_local_transports(4);
  std::vector<std::shared_ptr<Transport>> wrapped;
  std::vector<Transport*> raw;
  for (auto& t : locals) {
    wrapped.push_back(std::make_shared<ChecksummingTransport>(std::shared_ptr<Transport>(std::move(t))));
    raw.push_back(wrapped.back().get());
  }
  const RankErrors errors = run_rank_threads(raw, [&](Transport& t) {
    testing::check_async_shards(t, kWait);
    auto pair = t.split(t.rank() % 2, t.rank(), kWait);
    testing::check_round_trip_matches_all_reduce(*pair, kWait, /*bitwise=*/true);
  });
  EXPECT_FALSE(errors.root_cause()) << error_message(errors.root_cause());
}

}  // namespace
}  // namespace twobp
