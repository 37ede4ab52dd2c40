// InterruptGuard: SIGINT and SIGTERM are recorded instead of ending the process, every rank agrees on them at the
// same step (threads: the signal may arrive while some ranks already asked), the exit status is the shell's, the
// previous handlers come back, a second signal ends the process at once, and one guard at a time.

#include "twobp/runtime/interrupt.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

const Duration kTimeout = std::chrono::seconds(30);

TEST(Interrupt, EachSignalIsRecordedWithTheShellsExitStatus) {
  for (const auto& [signal, status] : std::vector<std::pair<int, int>>{{SIGINT, 130}, {SIGTERM, 143}}) {
    InterruptGuard guard;
    EXPECT_EQ(guard.received(), 0);
    EXPECT_EQ(guard.exit_status(), 0);
    EXPECT_STREQ(guard.received_name(), "");
    ASSERT_EQ(std::raise(signal), 0);  // the process goes on
    EXPECT_EQ(guard.received(), signal);
    EXPECT_EQ(guard.exit_status(), status);
    EXPECT_STREQ(guard.received_name(), signal == SIGINT ? "SIGINT" : "SIGTERM");
  }
}

TEST(Interrupt, EveryRankStopsAfterTheSameStep) {
  constexpr int kRanks = 3, kSignalAt = 4, kSteps = 10;
  for (int raiser = 0; raiser < kRanks; ++raiser) {  // whichever rank's thread the signal lands on
    InterruptGuard guard;
    std::vector<int> stopped(kRanks, -1);
    auto transports = make_local_transports(kRanks);
    const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
      for (int step = 0; step < kSteps; ++step) {
        if (t.rank() == raiser && step == kSignalAt) std::raise(SIGINT);
        if (guard.agreed(t, kTimeout)) {
          stopped[t.rank()] = step;
          return;
        }
      }
    });
    ASSERT_TRUE(errors.ok());
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(stopped[r], kSignalAt) << "rank " << r << ", raised on " << raiser;
    EXPECT_EQ(guard.exit_status(), 130);
  }
}

TEST(Interrupt, WithoutASignalNoRankStops) {
  InterruptGuard guard;
  auto transports = make_local_transports(2);
  std::atomic<int> stops{0};
  ASSERT_TRUE(run_rank_threads(transports, [&](Transport& t) {
                for (int step = 0; step < 5; ++step) stops += guard.agreed(t, kTimeout);
              }).ok());
  EXPECT_EQ(stops, 0);
}

// The first signal is acknowledged at once (by the handler itself), with the program's current announcement; a
// guard made with announce = false (the other ranks of a job) stays silent.
TEST(Interrupt, TheFirstSignalIsAcknowledgedAtOnce) {
  {
    InterruptGuard guard;
    guard.set_announcement("finishing step 3 of 10, then writing run.json");
    guard.set_announcement("finishing step 4 of 10, then writing run.json");  // the latest counts
    ::testing::internal::CaptureStderr();
    ASSERT_EQ(std::raise(SIGTERM), 0);
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(said, "interrupt: SIGTERM received: finishing step 4 of 10, then writing run.json (a second signal "
                    "ends the process now)\n");
  }
  {
    InterruptGuard guard;  // the default announcement
    ::testing::internal::CaptureStderr();
    ASSERT_EQ(std::raise(SIGINT), 0);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(),
              "interrupt: SIGINT received: finishing the work in progress (a second signal ends the process now)\n");
  }
  {
    InterruptGuard guard(/*announce=*/false);
    guard.set_announcement(std::string(1000, 'x'));  // kept to its first 400 bytes, never past the buffer
    ::testing::internal::CaptureStderr();
    ASSERT_EQ(std::raise(SIGINT), 0);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(guard.received(), SIGINT);
  }
}

TEST(Interrupt, ThePreviousHandlersComeBack) {
  struct sigaction before {}, after {};
  ::sigaction(SIGTERM, nullptr, &before);
  { InterruptGuard guard; }
  ::sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(before.sa_handler, after.sa_handler);
}

TEST(Interrupt, OneGuardAtATime) {
  InterruptGuard guard;
  EXPECT_THROW(InterruptGuard second, UsageError);
}

TEST(InterruptDeathTest, ASecondSignalEndsTheProcessAtOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InterruptGuard guard;
        std::raise(SIGINT);
        std::raise(SIGINT);
        std::exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGINT), "");
}

}  // namespace
}  // namespace twobp::testing
