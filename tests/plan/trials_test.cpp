// The trial loop (twobp/plan/trials.h): each candidate's time is the slowest rank's median over its measured steps
// (the first is warm-up), the same on every rank of every replica; the fastest is kept.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "common/expect_error.h"
#include "twobp/error.h"
#include "twobp/plan/trials.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr Duration kTimeout = std::chrono::seconds(30);

// Two replicas of a two-rank pipeline as four threads: world rank (d, r) is pipeline rank r of replica d, its
// replica group the ranks r of every replica.
TEST(Trial, TakesTheSlowestRanksMedianOverTheRanksAndTheReplicas) {
  std::vector<std::vector<std::unique_ptr<Transport>>> pipelines, replicas;
  for (int k = 0; k < 2; ++k) {
    pipelines.push_back(make_local_transports(2));
    replicas.push_back(make_local_transports(2));
  }
  // Rank (d, r) measures base + {3, 1, 2}: median base + 2; its warm-up step (1000 ms) is left out.
  auto base = [](int d, int r) { return 10.0 * d + 5.0 * r; };
  std::vector<std::vector<double>> agreed(4);
  std::vector<std::thread> threads;
  for (int d = 0; d < 2; ++d) {
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, d, r] {
        Trial trial(*pipelines[d][r], replicas[r][d].get(), kTimeout);
        for (int candidate = 0; candidate < 2; ++candidate) {
          trial.start(4);
          EXPECT_FALSE(trial.add(1000.0));  // warm-up
          for (double x : {3.0, 1.0, 2.0}) {
            EXPECT_FALSE(trial.complete());
            EXPECT_TRUE(trial.add(base(d, r) + x + candidate));
          }
          EXPECT_TRUE(trial.complete());
          agreed[2 * d + r].push_back(trial.finish());
          EXPECT_EQ(trial.steps_taken(), 0);
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (const auto& mine : agreed) EXPECT_EQ(mine, (std::vector<double>{10.0 + 5.0 + 2.0, 10.0 + 5.0 + 3.0}));
}

TEST(Trial, WithoutReplicasAgreesOverThePipelinesRanks) {
  auto ranks = make_local_transports(3);
  std::vector<double> agreed(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      Trial trial(*ranks[r], nullptr, kTimeout);
      trial.start(2);
      trial.add(0.0);
      trial.add(1.0 + r);
      agreed[r] = trial.finish();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(agreed, (std::vector<double>{3.0, 3.0, 3.0}));
}

TEST(Trial, RefusesMeasurementsOutOfOrder) {
  auto ranks = make_local_transports(1);
  Trial trial(*ranks[0], nullptr, kTimeout);
  expect_error<UsageError>([&] { trial.add(1.0); }, {"no measurement is running"});
  expect_error<UsageError>([&] { trial.start(1); }, {">= 2 steps"});
  trial.start(2);
  trial.add(1.0);
  expect_error<UsageError>([&] { trial.finish(); }, {"1 of 2 steps measured"});
  trial.add(2.0);
  expect_error<UsageError>([&] { trial.add(3.0); }, {"no measurement is running"});
  EXPECT_EQ(trial.finish(), 2.0);
}

// Issue 69: a step time that is not a time (NaN, +inf, -inf, negative) is refused naming the step; 0 is taken (a
// step shorter than the clock's tick). The measurement goes on with the next good one.
TEST(Trial, RefusesStepTimesThatAreNotTimes) {
  auto ranks = make_local_transports(1);
  Trial trial(*ranks[0], nullptr, kTimeout);
  trial.start(3);
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {std::nan(""), inf, -inf, -1.0}) {
    expect_error<UsageError>([&] { trial.add(bad); }, {"Trial::add (step 1 of 3): step_ms is ", "finite time"});
  }
  EXPECT_FALSE(trial.add(0.0));
  EXPECT_EQ(trial.steps_taken(), 1) << "a refused step is not taken";
  expect_error<UsageError>([&] { trial.add(std::nan("")); }, {"step 2 of 3"});
  EXPECT_TRUE(trial.add(4.0));
  EXPECT_TRUE(trial.add(0.0));
  EXPECT_EQ(trial.finish(), 2.0);
}

TEST(MeasuredAgainstPrediction, SaysHowFarThePredictionIsFromTheMeasurement) {
  EXPECT_EQ(measured_against_prediction(8.0, 8.0), "measured 8.00 ms/step (predicted 8.00)");
  EXPECT_EQ(measured_against_prediction(8.0, 8.03), "measured 8.00 ms/step (predicted 8.03)");  // within 0.5 %
  EXPECT_EQ(measured_against_prediction(10.0, 6.0), "measured 10.00 ms/step (predicted 6.00, 40 % below)");
  EXPECT_EQ(measured_against_prediction(10.0, 12.5), "measured 10.00 ms/step (predicted 12.50, 25 % above)");
  EXPECT_EQ(measured_against_prediction(10.0, 0.0), "measured 10.00 ms/step (not predicted)");
  EXPECT_EQ(measured_against_prediction(0.0, 5.0), "measured 0.00 ms/step (predicted 5.00)");
}

TEST(Fastest, IsTheSmallestAndTheFirstOfTies) {
  EXPECT_EQ(fastest({3.0, 1.0, 2.0}), 1u);
  EXPECT_EQ(fastest({2.0, 1.0, 1.0}), 1u);
  EXPECT_EQ(fastest({1.0}), 0u);
  expect_error<UsageError>([] { fastest({}); }, {"no measured candidate"});
  // Issue 69: a NaN compares false with every time, so min_element would keep it; refused, as inf and negatives.
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {std::nan(""), inf, -inf, -1.0}) {
    expect_error<UsageError>([&] { fastest({bad, 5.0}); }, {"fastest: ms[0] is "});
    expect_error<UsageError>([&] { fastest({5.0, bad}); }, {"fastest: ms[1] is "});
  }
  EXPECT_EQ(fastest({5.0, 0.0}), 1u);
}

}  // namespace
}  // namespace twobp::testing
