// A job's ranks (twobp/runtime/job.h): threads of this process without a launcher, one process each under one
// (here torchrun's environment, read but not connected to).
#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>
#include <set>

#include "twobp/runtime/job.h"

namespace twobp::testing {
namespace {

TEST(Job, RunsThreadRanksWithoutALauncher) {
  ASSERT_FALSE(launch_env().has_value()) << "run this test outside a launcher";
  const Job job(nullptr, nullptr, 3, /*cuda=*/false);
  EXPECT_FALSE(job.processes());
  EXPECT_EQ(job.world_size(), 3);
  EXPECT_EQ(job.rank(), 0);
  EXPECT_EQ(job.how(), "threads");
  EXPECT_EQ(job.ranks_on_node(), 3);
  std::mutex mutex;
  std::set<int> ranks;
  run_ranks(job.run_options(), [&](Transport& t) {
    EXPECT_EQ(t.world_size(), 3);
    EXPECT_TRUE(job.device_of(t).is_cpu());
    std::lock_guard<std::mutex> lock(mutex);
    ranks.insert(t.rank());
  });
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
}

TEST(Job, IsOneRankOfTheLaunchersUnderALauncher) {
  if (launched_by_mpi_launcher()) GTEST_SKIP() << "under an MPI launcher";
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  const Job job(nullptr, nullptr, 3, /*cuda=*/false);
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) unsetenv(name);
  EXPECT_TRUE(job.processes());
  EXPECT_EQ(job.world_size(), 4);
  EXPECT_EQ(job.rank(), 1);
  EXPECT_EQ(job.how(), "processes, torchrun + TCPStore");
  EXPECT_EQ(job.ranks_on_node(), 2);
  EXPECT_EQ(job.run_options().thread_ranks, 3);  // unused under a launcher
}

}  // namespace
}  // namespace twobp::testing
