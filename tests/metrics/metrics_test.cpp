// Each formula of twobp/metrics/metrics.h on values computed by hand.

#include "twobp/metrics/metrics.h"

#include <gtest/gtest.h>

namespace twobp::testing {
namespace {

TEST(Metrics, BubbleFractionIsIdleOverRanksTimesStep) {
  // 2 ranks, step 10: rank 0 busy 8 (idle 2), rank 1 busy 6 (idle 4): 6 / 20.
  EXPECT_DOUBLE_EQ(metrics::bubble_fraction(std::vector<double>{8.0, 6.0}, 10.0), 0.3);
  EXPECT_DOUBLE_EQ(metrics::bubble_fraction(14.0, 2, 10.0), 0.3);
  EXPECT_DOUBLE_EQ(metrics::bubble_fraction(std::vector<double>{10.0}, 10.0), 0.0);
  EXPECT_DOUBLE_EQ(metrics::bubble_fraction(std::vector<double>{}, 10.0), 0.0);
  EXPECT_DOUBLE_EQ(metrics::bubble_fraction(std::vector<double>{1.0}, 0.0), 0.0);
  EXPECT_DOUBLE_EQ(metrics::bubble_fraction(1.0, 0, 10.0), 0.0);
}

TEST(Metrics, Throughput) {
  EXPECT_DOUBLE_EQ(metrics::per_second(64.0, 0.5), 128.0);
  EXPECT_DOUBLE_EQ(metrics::per_second(64.0, 0.0), 0.0);
  EXPECT_DOUBLE_EQ(metrics::tokens_per_s(128.0, 256), 32768.0);
  EXPECT_DOUBLE_EQ(metrics::tokens_per_s(128.0, 0), 0.0);  // resnet: no tokens
}

TEST(Metrics, EfficiencyAndMemoryPerRank) {
  EXPECT_DOUBLE_EQ(metrics::efficiency(7.0, 10.0), 0.7);
  EXPECT_DOUBLE_EQ(metrics::efficiency(7.0, 0.0), 0.0);
  EXPECT_DOUBLE_EQ(metrics::memory_per_rank(4096.0, 4), 1024.0);
  EXPECT_DOUBLE_EQ(metrics::memory_per_rank(4096.0, 1), 4096.0);
  EXPECT_DOUBLE_EQ(metrics::memory_per_rank(4096.0, 0), 4096.0);
}

TEST(Metrics, TrainingMemory) {
  // 1000 fp32 parameters: 4000 weights + 4000 grads + 8000 AdamW; 3 live micro-batches of 500 bytes.
  EXPECT_EQ(metrics::training_memory_bytes(1000, 4, 3, 500), 17500);
  EXPECT_EQ(metrics::training_memory_bytes(1000, 2, 0, 500), 8000);
}

}  // namespace
}  // namespace twobp::testing
