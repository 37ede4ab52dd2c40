// Each formula of twobp/metrics/metrics.h on values computed by hand.

#include "twobp/metrics/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "twobp/error.h"

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
  EXPECT_DOUBLE_EQ(metrics::per_item(3.0, 1536.0), 3.0 / 1536.0);  // joules per token
  EXPECT_DOUBLE_EQ(metrics::per_item(3.0, 0.0), 0.0);
  EXPECT_DOUBLE_EQ(metrics::tokens_per_s(128.0, 256), 32768.0);
  EXPECT_DOUBLE_EQ(metrics::tokens_per_s(128.0, 0), 0.0);  // resnet: no tokens
}

TEST(Metrics, MemoryPerRank) {
  EXPECT_DOUBLE_EQ(metrics::memory_per_rank(4096.0, 4), 1024.0);
  EXPECT_DOUBLE_EQ(metrics::memory_per_rank(4096.0, 1), 4096.0);
  EXPECT_DOUBLE_EQ(metrics::memory_per_rank(4096.0, 0), 4096.0);
}

TEST(Metrics, RingAllReduce) {
  // 8 ranks, 1 GB over 12.5 GB/s (100 Gbit/s) and 5 us per step: 2·7/8 · 0.08 s + 14 · 5 us = 0.14 + 0.00007.
  EXPECT_NEAR(metrics::ring_all_reduce_seconds(1e9, 8, 12.5e9, 5e-6), 0.14007, 1e-15);
  // 2 ranks: each sends half and receives half twice -> bytes / bandwidth, plus 2 latencies.
  EXPECT_DOUBLE_EQ(metrics::ring_all_reduce_seconds(100.0, 2, 10.0, 1.0), 12.0);
  // 4 ranks, no latency: 2·3/4 = 1.5 bytes per byte of buffer.
  EXPECT_DOUBLE_EQ(metrics::ring_all_reduce_seconds(400.0, 4, 100.0, 0.0), 6.0);
  // Nothing to reduce: one rank, or no bytes.
  EXPECT_DOUBLE_EQ(metrics::ring_all_reduce_seconds(1e9, 1, 12.5e9, 5e-6), 0.0);
  EXPECT_DOUBLE_EQ(metrics::ring_all_reduce_seconds(1e9, 0, 12.5e9, 5e-6), 0.0);
  EXPECT_DOUBLE_EQ(metrics::ring_all_reduce_seconds(0.0, 8, 12.5e9, 5e-6), 0.0);
  EXPECT_DOUBLE_EQ(metrics::ring_all_reduce_seconds(1e9, 1, 0.0, 0.0), 0.0) << "one rank needs no link";
}

// Issue 69: a size, time or bandwidth that is not one is refused naming the argument (a negative size was priced
// at 0, a NaN one at NaN); a bandwidth of 0 means nothing where bytes cross the link.
TEST(Metrics, RingAllReduceRefusesNumbersThatAreNotSizesTimesOrBandwidths) {
  const double inf = std::numeric_limits<double>::infinity();
  auto refused = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << needle << ": taken";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("ring_all_reduce_seconds: " + needle), std::string::npos) << e.what();
    }
  };
  for (double bad : {std::nan(""), inf, -inf, -1.0}) {
    refused([&] { metrics::ring_all_reduce_seconds(bad, 8, 12.5e9, 5e-6); }, "bytes is ");
    refused([&] { metrics::ring_all_reduce_seconds(1e9, 8, 12.5e9, bad); }, "latency_s is ");
    refused([&] { metrics::ring_all_reduce_seconds(1e9, 8, bad, 5e-6); }, "link_bytes_per_s is ");
  }
  refused([] { metrics::ring_all_reduce_seconds(1e9, 8, 0.0, 5e-6); }, "link_bytes_per_s is 0");
}

TEST(Metrics, ExposedWait) {
  // The slowest rank's wait is what the step exposes.
  EXPECT_DOUBLE_EQ(metrics::exposed_wait({0.5, 3.0, 1.25, 0.0}), 3.0);
  // No ranks, or nobody waited (a negative wait, e.g. clock noise, counts as none).
  EXPECT_DOUBLE_EQ(metrics::exposed_wait({}), 0.0);
  EXPECT_DOUBLE_EQ(metrics::exposed_wait({0.0, -1e-9}), 0.0);
}

TEST(Metrics, QuantileInterpolatesBetweenTheNearestRanks) {
  // Unsorted input; an odd count's median is the middle sample, an even count's the mean of the two middle ones.
  EXPECT_DOUBLE_EQ(metrics::quantile({3.0, 1.0, 2.0}, 0.5), 2.0);
  EXPECT_DOUBLE_EQ(metrics::quantile({4.0, 1.0, 3.0, 2.0}, 0.5), 2.5);
  // q = 0.25 of 1..5: position 1 exactly; of 1..4: 0.75 of the way from 1 to 2.
  EXPECT_DOUBLE_EQ(metrics::quantile({5.0, 4.0, 3.0, 2.0, 1.0}, 0.25), 2.0);
  EXPECT_DOUBLE_EQ(metrics::quantile({1.0, 2.0, 3.0, 4.0}, 0.25), 1.75);
  EXPECT_DOUBLE_EQ(metrics::quantile({7.0, -1.0}, 0.0), -1.0);
  EXPECT_DOUBLE_EQ(metrics::quantile({7.0, -1.0}, 1.0), 7.0);
  EXPECT_DOUBLE_EQ(metrics::quantile({42.0}, 0.5), 42.0);
  EXPECT_TRUE(std::isnan(metrics::quantile({}, 0.5)));
}

TEST(Metrics, SummaryAndSeries) {
  const metrics::Summary s = metrics::summarize({5.0, 1.0, 4.0, 2.0, 3.0});
  EXPECT_EQ(s.count, 5u);
  EXPECT_DOUBLE_EQ(s.min, 1.0);
  EXPECT_DOUBLE_EQ(s.p25, 2.0);
  EXPECT_DOUBLE_EQ(s.median, 3.0);
  EXPECT_DOUBLE_EQ(s.p75, 4.0);
  EXPECT_DOUBLE_EQ(s.max, 5.0);
  EXPECT_TRUE(std::isnan(metrics::summarize({}).median));
  metrics::Series series;
  series.add("b_ms", 3.0);
  series.add("a_ms", 1.0);
  series.add("b_ms", 1.0);
  ASSERT_EQ(series.all().size(), 2u);
  EXPECT_EQ(series.all()[0].first, "b_ms") << "first use's order";
  EXPECT_EQ(series.get("b_ms"), (std::vector<double>{3.0, 1.0}));
  EXPECT_DOUBLE_EQ(series.median("b_ms"), 2.0);
  EXPECT_TRUE(series.has("a_ms"));
  EXPECT_FALSE(series.has("c_ms"));
  EXPECT_THROW(series.get("c_ms"), UsageError);
}

// The warning names the command and the quieter setting exactly when the load average exceeds the cores.
TEST(Metrics, LoadWarningOnlyWhenTheLoadExceedsTheCores) {
  const double cores = std::thread::hardware_concurrency();
  const std::string warning = metrics::load_warning("cmd", "--quiet", cores + 0.5);
  EXPECT_EQ(warning.rfind("cmd: warning: load average ", 0), 0u) << warning;
  EXPECT_NE(warning.find("(or use --quiet)"), std::string::npos) << warning;
  EXPECT_EQ(metrics::load_warning("cmd", "--quiet", cores), "");
  EXPECT_EQ(metrics::load_warning("cmd", "--quiet", -1.0), "") << "no load average: no warning";
  EXPECT_GE(metrics::load_average(), -1.0);
}

}  // namespace
}  // namespace twobp::testing
