// The watchdog of stream-side waits (src/transport/watchdog.h; NcclOptions::stream_waits), with fake works: a poll
// function stands for the CUDA event and NCCL error queries of a real receive, so the part of the stream-side mode
// that needs no GPU -- timeout -> abort (once) -> an error naming the wait, raised by the owner's next call -- runs
// here. Every wait below is bounded.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/watchdog.h"
#include "twobp/error.h"

namespace twobp::watchdog_test {
namespace {

using namespace std::chrono_literals;
using detail::Watchdog;

/// A fake work: pending until completed (after `done_after` polls, or by complete()), or failing on its polls.
struct FakeWork {
  std::atomic<int> polls{0};
  std::atomic<bool> done{false};
  int done_after = -1;  // polls; -1: never by itself
  bool fail = false;

  Watchdog::Poll poll() {
    return [this] {
      const int n = ++polls;
      if (fail) throw TransportError("NCCL error 6: remote process exited (fake)");
      if (done_after >= 0 && n > done_after) done = true;
      return done.load();
    };
  }
};

/// Counts the abort callback's calls and keeps the last reason.
struct AbortLog {
  std::atomic<int> calls{0};
  std::mutex mutex;
  std::string reason;

  Watchdog::Abort callback() {
    return [this](const std::string& why) {
      std::lock_guard<std::mutex> lock(mutex);
      reason = why;
      ++calls;
    };
  }
  std::string last() {
    std::lock_guard<std::mutex> lock(mutex);
    return reason;
  }
};

/// Polls `condition` until true or `timeout`: the tests' own waits are bounded too.
template <class F>
bool eventually(F condition, Duration timeout = Duration(10000)) {
  const auto deadline = Clock::now() + timeout;
  while (!condition()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

/// This process's threads (Linux): the watchdog's thread must be gone once it is destroyed.
std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

constexpr const char* kWaitName = "RECV_F stage 1 micro-batch 2 (tag 9) from rank 0";

TEST(Watchdog, WaitsDoneInTimeAreDroppedWithoutAnAbort) {
  AbortLog aborts;
  FakeWork at_once, soon;  // before the watchdog: they outlive its polls
  Watchdog dog(3, aborts.callback(), "aborted the fake communicators", 200us);
  at_once.done_after = 0;
  soon.done_after = 20;
  dog.watch("at once", 10s, at_once.poll());
  dog.watch("soon", 10s, soon.poll());
  EXPECT_TRUE(dog.wait_until_idle(10s));
  EXPECT_EQ(dog.pending(), 0u);
  EXPECT_FALSE(dog.failed());
  EXPECT_NO_THROW(dog.check());
  // A completed wait is not polled again.
  const int polls = soon.polls;
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(soon.polls, polls);
  EXPECT_EQ(aborts.calls, 0);
}

TEST(Watchdog, DoneLateButWithinTheTimeoutIsNoFailure) {
  AbortLog aborts;
  FakeWork late;
  Watchdog dog(0, aborts.callback(), "aborted the fake communicators", 500us);
  dog.watch(kWaitName, 10s, late.poll());
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(dog.pending(), 1u);
  late.done = true;
  EXPECT_TRUE(dog.wait_until_idle(10s));
  EXPECT_NO_THROW(dog.check());
  EXPECT_EQ(aborts.calls, 0);
}

TEST(Watchdog, NeverDoneTimesOutAbortsOnceAndNamesTheWait) {
  AbortLog aborts;
  FakeWork never, other, later;
  Watchdog dog(3, aborts.callback(), "aborted the fake communicators", 500us);
  const auto start = Clock::now();
  dog.watch(kWaitName, 50ms, never.poll());
  dog.watch("RECV_B stage 1 micro-batch 0 (tag 4) from rank 2", 10s, other.poll());
  ASSERT_TRUE(eventually([&] { return dog.failed(); }));
  EXPECT_GE(Clock::now() - start, 50ms);
  ASSERT_TRUE(eventually([&] { return aborts.calls.load() == 1; }));
  std::this_thread::sleep_for(50ms);  // and no second abort (the other wait is dropped with the failure)
  EXPECT_EQ(aborts.calls, 1);
  EXPECT_EQ(dog.pending(), 0u);
  EXPECT_FALSE(dog.wait_until_idle(10ms));

  // The error names the rank, the wait and its timeout; the abort was told the same text.
  std::string text;
  try {
    dog.check();
    ADD_FAILURE() << "check() did not throw";
  } catch (const TimeoutError& e) {
    text = e.what();
  }
  EXPECT_NE(text.find("rank 3: timed out after 50 ms waiting for " + std::string(kWaitName)), std::string::npos) << text;
  EXPECT_NE(text.find("aborted the fake communicators"), std::string::npos) << text;
  EXPECT_EQ(aborts.last(), text);
  // Raised again by every later call: a new exception each time, of the same type and text.
  EXPECT_THROW(dog.check(), TimeoutError);
  // Nothing more is watched after a failure: watch() raises the recorded error instead, and never aborts again.
  try {
    dog.watch("RECV_F stage 1 micro-batch 3 (tag 11) from rank 0", 10s, later.poll());
    ADD_FAILURE() << "watch() after a failure did not throw";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(std::string(e.what()), text);
  }
  std::this_thread::sleep_for(10ms);
  EXPECT_EQ(dog.pending(), 0u);
  EXPECT_EQ(later.polls, 0);
  EXPECT_EQ(aborts.calls, 1);
}

TEST(Watchdog, DoneAfterItsTimeoutIsATimeout) {
  AbortLog aborts;
  FakeWork late;
  Watchdog dog(1, aborts.callback(), "aborted the fake communicators", 500us);
  dog.watch(kWaitName, 30ms, late.poll());
  ASSERT_TRUE(eventually([&] { return dog.failed(); }));
  late.done = true;  // too late: the communicators were aborted already
  EXPECT_THROW(dog.check(), TimeoutError);
  EXPECT_TRUE(eventually([&] { return aborts.calls.load() == 1; }));
}

TEST(Watchdog, FailingPollAbortsWithAnErrorNamingTheWait) {
  AbortLog aborts;
  FakeWork broken;
  Watchdog dog(2, aborts.callback(), "aborted the fake communicators", 500us);
  broken.fail = true;
  dog.watch(kWaitName, 10s, broken.poll());
  ASSERT_TRUE(eventually([&] { return aborts.calls.load() == 1; }));
  try {
    dog.check();
    ADD_FAILURE() << "check() did not throw";
  } catch (const TransportError& e) {
    const std::string text = e.what();
    EXPECT_NE(text.find("rank 2: " + std::string(kWaitName) + " failed"), std::string::npos) << text;
    EXPECT_NE(text.find("remote process exited"), std::string::npos) << text;
  }
  EXPECT_EQ(broken.polls, 1);  // dropped after its failure
}

TEST(Watchdog, AnAbortThatThrowsIsSwallowed) {
  std::atomic<int> calls{0};
  FakeWork never;
  Watchdog dog(
      0,
      [&](const std::string&) {
        ++calls;
        throw TransportError("the abort itself failed");
      },
      "aborted nothing", 500us);
  dog.watch(kWaitName, 10ms, never.poll());
  ASSERT_TRUE(eventually([&] { return calls.load() == 1; }));
  EXPECT_THROW(dog.check(), TimeoutError);
}

TEST(Watchdog, DestructionJoinsItsThreadAndDropsPendingWaits) {
  const std::size_t before = thread_count();
  AbortLog aborts;
  auto never = std::make_shared<FakeWork>();
  {
    Watchdog dog(0, aborts.callback(), "aborted the fake communicators", 500us);
    EXPECT_EQ(thread_count(), before + 1);
    dog.watch(kWaitName, 10min, never->poll());
    ASSERT_TRUE(eventually([&] { return never->polls.load() > 2; }));
    EXPECT_FALSE(dog.wait_until_idle(20ms));  // bounded: the wait is still pending
    const auto start = Clock::now();
    {
      Watchdog idle(1, aborts.callback(), "aborted nothing");  // never watched anything: its thread sleeps
    }
    EXPECT_LT(Clock::now() - start, 1s);
  }
  EXPECT_EQ(thread_count(), before);
  const int polls = never->polls;
  std::this_thread::sleep_for(10ms);
  EXPECT_EQ(never->polls, polls);  // not polled after the destructor returned
  EXPECT_EQ(aborts.calls, 0);
}

TEST(Watchdog, ManyWaitsFromSeveralThreads) {
  AbortLog aborts;
  constexpr int kThreads = 4, kPerThread = 50;
  std::vector<std::unique_ptr<FakeWork>> works;
  for (int k = 0; k < kThreads * kPerThread; ++k) {
    works.push_back(std::make_unique<FakeWork>());
    works.back()->done_after = k % 7;
  }
  Watchdog dog(0, aborts.callback(), "aborted the fake communicators", 100us);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        dog.watch("wait " + std::to_string(t * kPerThread + k), 10s, works[t * kPerThread + k]->poll());
        EXPECT_NO_THROW(dog.check());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_TRUE(dog.wait_until_idle(10s));
  EXPECT_EQ(aborts.calls, 0);
  for (const auto& w : works) EXPECT_TRUE(w->done);
}

}  // namespace
}  // namespace twobp::watchdog_test
