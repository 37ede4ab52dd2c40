// run_ranks and run_rank_threads: every rank runs, a failing rank aborts its peers, the root cause wins.
// exit_without_teardown: the status and what was written but not flushed reach the caller.

#include "twobp/runtime/launch.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "twobp/error.h"

namespace twobp::testing {
namespace {

TEST(RunRanks, RunsEveryThreadRankOnItsOwnTransport) {
  if (launch_env()) GTEST_SKIP() << "started by a launcher: run_ranks would run one rank per process";
  RunRanksOptions o;
  o.thread_ranks = 3;
  std::atomic<int> mask{0};
  run_ranks(o, [&](Transport& t) {
    EXPECT_EQ(t.world_size(), 3);
    EXPECT_EQ(t.name(), "local");
    mask |= 1 << t.rank();
    t.barrier(std::chrono::seconds(30));
  });
  EXPECT_EQ(mask.load(), 7);
}

TEST(RunRanks, RethrowsTheRootCauseNotThePeersAbort) {
  if (launch_env()) GTEST_SKIP() << "started by a launcher: run_ranks would run one rank per process";
  RunRanksOptions o;
  o.thread_ranks = 3;
  // Rank 2 fails; ranks 0 and 1 wait for it and fail from its abort, long before their timeout.
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_ranks(o, [](Transport& t) {
      if (t.rank() == 2) throw UsageError("injected failure");
      t.barrier(std::chrono::seconds(60));
    });
    FAIL() << "run_ranks returned";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(RunRankThreads, KeepsEveryRanksError) {
  auto transports = make_local_transports(3);
  RankErrors r = run_rank_threads(transports, [](Transport& t) {
    if (t.rank() == 1) throw UsageError("rank one is wrong");
    t.barrier(std::chrono::seconds(60));
  });
  ASSERT_EQ(r.errors.size(), 3u);
  EXPECT_FALSE(r.ok());
  for (int rank : {0, 2}) {
    ASSERT_TRUE(r.errors[rank]) << rank;
    EXPECT_THROW(std::rethrow_exception(r.errors[rank]), TransportError) << rank;
    const std::string what = error_message(r.errors[rank]);
    EXPECT_NE(what.find("rank one is wrong"), std::string::npos) << what;
  }
  EXPECT_EQ(error_message(r.root_cause()), "rank one is wrong");
  EXPECT_THROW(r.rethrow_root_cause(), UsageError);
}

TEST(RankErrors, RootCauseIsTheFirstErrorNotCausedByAnother) {
  RankErrors r;
  EXPECT_TRUE(r.ok());
  EXPECT_FALSE(r.root_cause());
  r.errors = {nullptr, std::make_exception_ptr(TransportError("aborted by rank 3")),
              std::make_exception_ptr(TimeoutError("timed out")), std::make_exception_ptr(IOError("disk full")),
              std::make_exception_ptr(UsageError("later"))};
  EXPECT_EQ(error_message(r.root_cause()), "disk full");
  // Only consequences: the first of them.
  r.errors = {std::make_exception_ptr(TimeoutError("timed out")), std::make_exception_ptr(TransportError("x"))};
  EXPECT_EQ(error_message(r.root_cause()), "timed out");
}

// The process ends with the status given, after C stdio and the C++ streams were flushed: a FILE still open and
// buffered, std::cerr; in a sanitizer build (std::exit) the same.
TEST(ExitWithoutTeardown, FlushesWhatWasWrittenAndEndsWithTheStatus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // LibTorch may have started threads: re-execute, not fork only
  const std::string path = ::testing::TempDir() + "/twobp_exit_without_teardown.txt";
  std::remove(path.c_str());
  EXPECT_EXIT(
      {
        std::FILE* f = std::fopen(path.c_str(), "w");  // never closed: only the flush at exit writes it
        if (f != nullptr) std::fputs("written before the end", f);
        std::cerr << "to the error stream";
        exit_without_teardown(3);
      },
      ::testing::ExitedWithCode(3), "to the error stream");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "written before the end");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace twobp::testing
