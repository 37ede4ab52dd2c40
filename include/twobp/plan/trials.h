#pragma once
// The trial loop of measure → plan → run: run each candidate (a schedule, a placement) for k steps, take its time
// as the slowest rank's median step time -- agreed over the pipeline's ranks and the data-parallel replicas, so
// every rank decides alike -- and keep the fastest. AutoSchedule (plan/choose.h) and PlacementSearch
// (plan/placement.h) measure with it.
//
//   Trial trial(pipeline.transport(), replicas, timeout);
//   trial.start(4);                                    // the first of the 4 steps is warm-up
//   ... after each step:  trial.add(result.pipeline_us / 1000.0);
//                         if (trial.complete()) ms.push_back(trial.finish());   // collective
//   std::size_t best = fastest(ms);

#include <cstddef>
#include <string>
#include <vector>

#include "twobp/transport/transport.h"

namespace twobp {

/// One candidate's measurement at a time. Not thread-safe; one per rank.
class Trial {
 public:
  /// `ranks`: the pipeline's ranks; `replicas`: the rank's data-parallel group (nullptr: none). Both must outlive
  /// the Trial.
  Trial(Transport& ranks, Transport* replicas, Duration timeout);

  /// Starts measuring the next candidate over `steps` steps (>= 2; the first is warm-up, left out). UsageError
  /// otherwise.
  void start(int steps);
  /// One step of the candidate (its pipeline time, ms). Returns whether it counts (false: the warm-up step).
  /// UsageError when no measurement is running or it is complete, or step_ms is NaN, infinite or negative (0 is
  /// taken: a step shorter than the clock's tick).
  bool add(double step_ms);
  /// Whether the candidate's steps have all run (finish() is due).
  bool complete() const { return steps_ > 0 && taken_ == steps_; }
  /// Collective over the ranks, then the replicas: the slowest rank's median of the counted steps (ms), the same
  /// on every rank. Ends the measurement. UsageError unless complete().
  double finish();
  /// Steps of the running measurement so far, warm-up included (0: none running).
  int steps_taken() const { return taken_; }

 private:
  Transport& ranks_;
  Transport* replicas_;
  Duration timeout_;
  int steps_ = 0;
  int taken_ = 0;
  std::vector<double> step_ms_;
};

/// The slowest rank's median of `step_ms` (0 when empty), agreed over `ranks` then `replicas` (nullptr: none):
/// collective, the same on every rank.
double slowest_median_ms(const std::vector<double>& step_ms, Transport& ranks, Transport* replicas,
                         Duration timeout);

/// "measured 12.30 ms/step (predicted 8.70, 29 % below)": a candidate's measured step time beside the simulator's
/// prediction, as AutoSchedule and PlacementSearch report each trial, so that a prediction far from what the job
/// then measures is said ("(predicted 8.00)" alone within 0.5 %; "(not predicted)" for predicted_ms <= 0).
std::string measured_against_prediction(double measured_ms, double predicted_ms);

/// The index of the smallest of `ms` (ties: the first). UsageError when empty, or an entry is NaN, infinite or
/// negative (naming it, "fastest: ms[0] is nan, ..."): a NaN would compare false with every other time.
std::size_t fastest(const std::vector<double>& ms);

}  // namespace twobp
