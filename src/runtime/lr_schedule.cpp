#include "twobp/runtime/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "twobp/error.h"
#include "util/check.h"

namespace twobp {

double WarmupCosine::at(int step) const {
  TWOBP_CHECK(std::isfinite(lr) && lr > 0, UsageError, "WarmupCosine: lr must be finite and > 0, got {}", lr);
  TWOBP_CHECK(steps >= 1, UsageError, "WarmupCosine: steps must be >= 1, got {}", steps);
  TWOBP_CHECK(warmup_steps >= -1, UsageError, "WarmupCosine: warmup_steps must be >= -1 (-1: steps / 10), got {}",
              warmup_steps);
  TWOBP_CHECK(min_ratio >= 0 && min_ratio <= 1, UsageError, "WarmupCosine: min_ratio must be in [0, 1], got {}",
              min_ratio);
  TWOBP_CHECK(step >= 0, UsageError, "WarmupCosine: step must be >= 0, got {}", step);
  const int warmup = warmup_steps >= 0 ? warmup_steps : steps / 10;
  if (step < warmup) return lr * (step + 1) / static_cast<double>(warmup);
  const double progress = std::min(1.0, (step - warmup) / static_cast<double>(std::max(1, steps - warmup)));
  return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

}  // namespace twobp
