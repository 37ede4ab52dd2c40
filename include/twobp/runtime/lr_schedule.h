#pragma once
// Learning-rate schedules: the rate of each step, given to the optimizer before it (ShardedOptimizer::set_lr).

namespace twobp {

/// Linear warm-up, then cosine decay: step s < warmup gets lr · (s + 1) / warmup; later steps decay along half a
/// cosine from lr (the first step after the warm-up) to lr · min_ratio (the run's last step, and any past it).
struct WarmupCosine {
  double lr = 1e-3;
  int steps = 1;           ///< the run's steps, warm-up included
  int warmup_steps = -1;   ///< -1: steps / 10; 0: none
  double min_ratio = 0.1;  ///< the rate at the end over lr, in [0, 1]

  /// The rate of step `step` (from 0). Throws UsageError naming the field when lr is not finite and positive,
  /// steps < 1, warmup_steps < -1, min_ratio outside [0, 1], or step < 0.
  double at(int step) const;
};

}  // namespace twobp
