// WarmupCosine (twobp/runtime/lr_schedule.h): the warm-up rises linearly to lr, the decay falls along half a cosine
// to lr · min_ratio at the last step, and bad fields are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/expect_error.h"
#include "twobp/runtime/lr_schedule.h"

namespace twobp::testing {
namespace {

TEST(WarmupCosine, RisesLinearlyThenDecaysAlongHalfACosine) {
  for (int steps : {1, 2, 7, 40, 101}) {
    for (int warmup : {-1, 0, 1, 3}) {
      if (warmup >= steps) continue;
      const WarmupCosine s{2.0, steps, warmup, 0.25};
      const int w = warmup >= 0 ? warmup : steps / 10;
      SCOPED_TRACE(::testing::Message() << "steps " << steps << " warmup " << warmup);
      for (int k = 0; k < w; ++k) EXPECT_DOUBLE_EQ(s.at(k), 2.0 * (k + 1) / w);
      EXPECT_DOUBLE_EQ(s.at(w), 2.0);  // the first step after the warm-up: the full rate
      for (int k = w + 1; k < steps; ++k) EXPECT_LT(s.at(k), s.at(k - 1)) << k;  // falls, step by step
      if (steps - w > 1) {
        // Half-way through the decay: the mean of lr and its end.
        const int decay = steps - w;
        if (decay % 2 == 0) EXPECT_NEAR(s.at(w + decay / 2), 2.0 * (0.25 + 0.75 * 0.5), 1e-12);
        EXPECT_NEAR(s.at(steps), 0.5, 1e-12);  // the end of the decay: lr · min_ratio, and it stays there
        EXPECT_NEAR(s.at(steps + 5), 0.5, 1e-12);
      }
    }
  }
  EXPECT_DOUBLE_EQ((WarmupCosine{1.0, 100, -1, 0.0}.at(9)), 1.0);  // -1: steps / 10 = 10 warm-up steps
  EXPECT_DOUBLE_EQ((WarmupCosine{1.0, 100, -1, 0.0}.at(0)), 0.1);
}

TEST(WarmupCosine, RefusesBadFieldsByName) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { WarmupCosine{nan, 10, 1, 0.1}.at(0); }, {"lr", "finite"});
  expect_error([] { WarmupCosine{-1.0, 10, 1, 0.1}.at(0); }, {"lr", "> 0"});
  expect_error([] { WarmupCosine{1.0, 0, 1, 0.1}.at(0); }, {"steps", ">= 1"});
  expect_error([] { WarmupCosine{1.0, 10, -2, 0.1}.at(0); }, {"warmup_steps", ">= -1"});
  expect_error([] { WarmupCosine{1.0, 10, 1, 1.5}.at(0); }, {"min_ratio", "[0, 1]"});
  expect_error([] { WarmupCosine{1.0, 10, 1, 0.1}.at(-1); }, {"step", ">= 0"});
}

}  // namespace
}  // namespace twobp::testing
