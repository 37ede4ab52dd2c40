// The CPU tensor-memory counter of twobp/metrics/memory.h: exact bytes per account, frees credited to the account
// that allocated (whatever thread frees), peaks, and one account per rank thread under run_rank_threads.
// A process of its own: the counter is installed once per process (count_cpu_allocations) and then stays.

#include "twobp/metrics/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

const c10::Device kCpu(c10::DeviceType::CPU);

// Runs first (definition order): before the counter is installed, CPU memory is not measurable and reading it
// says what to do.
TEST(MemoryCounter, AbsentUntilInstalled) {
  if (memory::counting_cpu_allocations()) GTEST_SKIP() << "the counter was installed by an earlier test";
  EXPECT_FALSE(memory::measurable(kCpu));
  try {
    memory::allocated(kCpu);
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("count_cpu_allocations()"), std::string::npos) << e.what();
  }
}

class MemoryCounterTest : public ::testing::Test {
 protected:
  void SetUp() override { memory::count_cpu_allocations(); }
};

TEST_F(MemoryCounterTest, CountsTensorStorageExactly) {
  ASSERT_TRUE(memory::measurable(kCpu));
  EXPECT_EQ(memory::source(kCpu), "cpu allocation counter");
  const int64_t start = memory::allocated(kCpu).current;
  memory::reset_peak(kCpu);
  EXPECT_EQ(memory::allocated(kCpu).peak, start);
  {
    at::Tensor a = at::empty({1000}, at::kDouble);  // 8000 bytes
    EXPECT_EQ(memory::allocated(kCpu).current, start + 8000);
    {
      at::Tensor b = at::empty({250}, at::kFloat);  // 1000 bytes
      EXPECT_EQ(memory::allocated(kCpu).current, start + 9000);
    }
    EXPECT_EQ(memory::allocated(kCpu).current, start + 8000);
    EXPECT_EQ(memory::allocated(kCpu).peak, start + 9000);
    at::Tensor view = a.slice(0, 0, 10);  // a view allocates no storage
    EXPECT_EQ(memory::allocated(kCpu).current, start + 8000);
  }
  EXPECT_EQ(memory::allocated(kCpu).current, start);
  memory::reset_peak(kCpu);
  EXPECT_EQ(memory::allocated(kCpu).peak, start);
}

TEST_F(MemoryCounterTest, FreeOnAnotherThreadCreditsTheAllocatingAccount) {
  const int64_t start0 = memory::allocated(kCpu).current;
  at::Tensor t;
  int64_t on_account_7 = 0, after_free_7 = -1;
  std::thread producer([&] {
    const memory::ScopedAccount account(7);
    EXPECT_EQ(memory::current_account(), 7);
    const int64_t before = memory::allocated(kCpu).current;
    t = at::empty({512}, at::kFloat);  // 2048 bytes on account 7
    on_account_7 = memory::allocated(kCpu).current - before;
  });
  producer.join();
  EXPECT_EQ(on_account_7, 2048);
  EXPECT_EQ(memory::current_account(), 0);
  EXPECT_EQ(memory::allocated(kCpu).current, start0);  // account 0 did not pay for it
  t.reset();                                           // freed on this thread (account 0)
  EXPECT_EQ(memory::allocated(kCpu).current, start0);
  std::thread reader([&] {
    const memory::ScopedAccount account(7);
    after_free_7 = memory::allocated(kCpu).current;
  });
  reader.join();
  EXPECT_EQ(after_free_7, 0) << "account 7 was credited when its tensor was freed elsewhere";
}

TEST_F(MemoryCounterTest, ScopedAccountsNestAndRejectOutOfRange) {
  {
    const memory::ScopedAccount outer(3);
    {
      const memory::ScopedAccount inner(4);
      EXPECT_EQ(memory::current_account(), 4);
    }
    EXPECT_EQ(memory::current_account(), 3);
  }
  EXPECT_EQ(memory::current_account(), 0);
  EXPECT_THROW(memory::ScopedAccount(-1), UsageError);
  EXPECT_THROW(memory::ScopedAccount(memory::kMaxAccounts), UsageError);
}

// run_rank_threads charges each rank thread's allocations to the account of its rank, so ranks sharing a process
// are told apart.
TEST_F(MemoryCounterTest, RankThreadsHaveAccountsOfTheirOwn) {
  auto transports = make_local_transports(3);
  std::vector<int> accounts(3, -1);
  std::vector<int64_t> held(3, -1);
  RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    const int r = t.rank();
    accounts[r] = memory::current_account();
    const int64_t before = memory::allocated(kCpu).current;
    at::Tensor mine = at::empty({(r + 1) * 100}, at::kDouble);
    t.barrier(std::chrono::seconds(30));  // every rank holds its tensor at once
    held[r] = memory::allocated(kCpu).current - before;
    t.barrier(std::chrono::seconds(30));
  });
  for (int r = 0; r < 3; ++r) {
    if (errors.errors[r]) std::rethrow_exception(errors.errors[r]);
    EXPECT_EQ(accounts[r], r);
    EXPECT_EQ(held[r], (r + 1) * 800) << "rank " << r << " saw another rank's tensors";
  }
}

}  // namespace
}  // namespace twobp::testing
