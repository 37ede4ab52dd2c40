// AtenOpCounter: top-level operators only, the autograd engine's node records transparent, one counter at a time.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "twobp/error.h"
#include "twobp/metrics/op_count.h"

namespace twobp::metrics {
namespace {

AtenOpCounterOptions options(bool by_name, bool thread_cpu_time = false) {
  AtenOpCounterOptions o;
  o.by_name = by_name;
  o.thread_cpu_time = thread_cpu_time;
  return o;
}

TEST(AtenOpCounter, CountsTopLevelOperatorsOnly) {
  const auto x = torch::randn({4, 3}), w = torch::randn({5, 3});
  AtenOpCounter counter(options(/*by_name=*/true));
  at::linear(x, w);  // calls t, matmul, mm inside: one top-level operator
  AtenOpCounter::Counts c = counter.take();
  EXPECT_EQ(c.ops, 1);
  EXPECT_EQ(c.by_name["aten::linear"], 1);
  EXPECT_EQ(c.by_name.size(), 1u);
  EXPECT_GE(c.inside_us, 0.0);
  auto y = x + 1;
  y.mul_(2);
  c = counter.take();
  EXPECT_EQ(c.ops, 2);
  EXPECT_EQ(counter.take().ops, 0) << "take() starts the next count at zero";
}

TEST(AtenOpCounter, CountsTheOperatorsOfABackwardNotItsNodes) {
  auto a = torch::randn({3}).requires_grad_(true);
  auto loss = (a * a).sum();
  AtenOpCounter counter(options(/*by_name=*/true));
  loss.backward();
  const AtenOpCounter::Counts c = counter.take();
  for (const auto& [name, n] : c.by_name) {
    EXPECT_EQ(name.rfind("aten::", 0), 0u) << name << " is not an operator";
  }
  // SumBackward expands (1), MulBackward multiplies twice (2) and the two gradients of `a` are summed (1).
  EXPECT_GE(c.ops, 3);
  EXPECT_TRUE(a.grad().defined());
}

TEST(AtenOpCounter, OneAtATimeAndTheClockIsConsistent) {
  {
    AtenOpCounter counter(options(/*by_name=*/false, /*thread_cpu_time=*/true));
    EXPECT_THROW(AtenOpCounter second, UsageError);
    const double start = counter.now_us();
    torch::randn({64, 64}).mm(torch::randn({64, 64}));
    const double elapsed = counter.now_us() - start;
    const AtenOpCounter::Counts c = counter.take();
    EXPECT_EQ(c.ops, 3);
    EXPECT_LE(c.inside_us, elapsed);
    EXPECT_LE(counter.outside_us(elapsed, c), elapsed);
  }
  AtenOpCounter again;  // the first one is gone
  torch::ones({2});
  EXPECT_EQ(again.take().ops, 1);
}

}  // namespace
}  // namespace twobp::metrics
