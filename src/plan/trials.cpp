#include "twobp/plan/trials.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"
#include "util/cost_check.h"

namespace twobp {

Trial::Trial(Transport& ranks, Transport* replicas, Duration timeout)
    : ranks_(ranks), replicas_(replicas), timeout_(timeout) {}

void Trial::start(int steps) {
  TWOBP_CHECK(steps >= 2, UsageError, "Trial: a candidate is measured over >= 2 steps (the first is warm-up), got {}",
              steps);
  steps_ = steps;
  taken_ = 0;
  step_ms_.clear();
}

bool Trial::add(double step_ms) {
  TWOBP_CHECK(steps_ > 0 && taken_ < steps_, UsageError,
              "Trial::add: no measurement is running (start() one; finish() a complete one)");
  detail::check_cost(step_ms, fmt::format("Trial::add (step {} of {})", taken_ + 1, steps_), "step_ms",
                     detail::kNoBound, "time in ms");
  ++taken_;
  if (taken_ == 1) return false;  // warm-up: a switch or a move just happened
  step_ms_.push_back(step_ms);
  return true;
}

double Trial::finish() {
  TWOBP_CHECK(complete(), UsageError, "Trial::finish: {} of {} steps measured", taken_, steps_);
  const double ms = slowest_median_ms(step_ms_, ranks_, replicas_, timeout_);
  steps_ = taken_ = 0;
  step_ms_.clear();
  return ms;
}

double slowest_median_ms(const std::vector<double>& step_ms, Transport& ranks, Transport* replicas,
                         Duration timeout) {
  const double mine = step_ms.empty() ? 0.0 : metrics::quantile(step_ms, 0.5);
  const double slowest = max_over_ranks(ranks, mine, timeout);
  return replicas == nullptr ? slowest : max_over_ranks(*replicas, slowest, timeout);
}

std::string measured_against_prediction(double measured_ms, double predicted_ms) {
  const std::string measured = fmt::format("measured {:.2f} ms/step", measured_ms);
  if (predicted_ms <= 0.0) return measured + " (not predicted)";
  if (measured_ms <= 0.0) return fmt::format("{} (predicted {:.2f})", measured, predicted_ms);  // nothing to compare
  const double off = predicted_ms / measured_ms - 1.0;
  if (std::abs(off) < 0.005) return fmt::format("{} (predicted {:.2f})", measured, predicted_ms);
  return fmt::format("{} (predicted {:.2f}, {:.0f} % {})", measured, predicted_ms, 100.0 * std::abs(off),
                     off < 0 ? "below" : "above");
}

std::size_t fastest(const std::vector<double>& ms) {
  TWOBP_CHECK(!ms.empty(), UsageError, "fastest: no measured candidate");
  detail::check_costs(ms, "fastest", "ms", detail::kNoBound, "time in ms");
  return static_cast<std::size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
}

}  // namespace twobp
