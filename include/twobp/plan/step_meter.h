#pragma once
// StepMeter: the measured steps of one Pipeline -- step times taken between barriers over the whole job, what each
// step's trace says (busy time, per-stage costs, memory, where the time went) -- and their summary, agreed over the
// pipeline's ranks. What `twobp_bench pipeline` reports per configuration; docs/BENCHMARKS.md defines the metrics.
//
//   StepMeter meter(pipeline, world);                       // every rank, the same arguments
//   for (int k = 0; k < warmup + steps; ++k) meter.step(inputs, targets, /*record=*/k >= warmup);
//   MeteredSteps s = meter.summarize(groups);               // collective over the world
//   simulate(pipeline.schedule(), s.costs.cost_model(mode)); // the prediction from the same steps

#include <optional>
#include <vector>

#include "twobp/plan/measure.h"
#include "twobp/tensors.h"
#include "twobp/trace/attribution.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

namespace twobp {

class Pipeline;
class ParallelGroups;
struct StepResult;
namespace energy {
class RankEnergy;
}

struct StepMeterOptions {
  /// Every barrier and collective gives up after this long (TimeoutError).
  Duration timeout = std::chrono::minutes(5);
  /// This rank's energy share, read around every recorded step (twobp/metrics/energy.h); null: not measured.
  energy::RankEnergy* energy = nullptr;
};

/// The summary of a StepMeter's recorded steps, the same on every rank of a pipeline (per-pipeline values are
/// those of the caller's replica).
struct MeteredSteps {
  int steps = 0;
  /// Per recorded step, pipeline rank 0's step time in ms (between barriers over the world, so every rank's).
  std::vector<double> step_ms;
  /// Per recorded step: 1 - (the ranks' summed busy time) / (p x step time) (metrics::bubble_fraction).
  std::vector<double> bubble;
  /// The per-stage costs of the recorded steps (CostRecorder), agreed over the pipeline; communication is 0.
  MeasuredCosts costs;
  /// Measured and predicted peak tensor memory per pipeline rank (compare_peak_memory); empty unless the
  /// pipeline runs with ExecutorOptions::record_memory.
  std::optional<PeakMemory> memory;
  /// Per pipeline rank, where its step time went: the mean over the recorded steps.
  std::vector<StepAttribution> attribution;
  /// The last recorded step's trace of every pipeline rank.
  std::vector<Trace> last_traces;
  /// The job's energy per recorded step in joules, every world rank's share summed (energy::job_energy); nullopt
  /// when no meter was given or a rank's hardware goes unmeasured.
  std::optional<double> energy_j;
  /// With data parallelism: per recorded step, the longest wait of any world rank for its gradient reductions
  /// (StepResult::reduce_wait_us, metrics::exposed_wait), in ms. Empty with one replica.
  std::vector<double> exposed_reduce_ms;
};

/// Records the steps of `pipeline` on this rank of `world` (the whole job: dp x p ranks; with one replica the
/// pipeline's own transport). Every rank of the world makes one StepMeter per pipeline and calls step() and
/// summarize() in the same order. The pipeline and the world must outlive the meter. The pipeline may switch
/// schedules between steps (Pipeline::switch_schedule keeps the placement, by whose stages the meter records).
class StepMeter {
 public:
  StepMeter(Pipeline& pipeline, Transport& world, StepMeterOptions options = {});

  /// One training step without an optimizer: zero_grad, a barrier over the world, Pipeline::step, a barrier; the
  /// step time is this rank's from the first barrier's end to the second's (its idle time at the end included).
  /// Recorded (`record`) or a warm-up step (not).
  void step(const NamedTensors& inputs, const NamedTensors& targets, bool record = true);

  /// Records a step the caller ran and timed itself (e.g. with its optimizer: StepTimes::optimizer_us).
  /// `energy_j`: this rank's share over the step (nullopt: not measured).
  void add(StepResult result, const StepTimes& times, std::optional<double> energy_j = std::nullopt);

  /// Steps recorded so far.
  int steps() const { return static_cast<int>(step_ms_.size()); }
  /// This rank's step time per recorded step, in ms.
  const std::vector<double>& step_ms() const { return step_ms_; }

  /// The recorded steps' summary (MeteredSteps). Collective over the world; throws UsageError when no step was
  /// recorded.
  MeteredSteps summarize(ParallelGroups& groups) const;

 private:
  Pipeline& pipeline_;
  Transport& world_;
  StepMeterOptions options_;
  CostRecorder costs_;
  std::optional<MemoryRecorder> memory_;  // when the pipeline records memory
  std::vector<double> step_ms_, busy_ms_, reduce_wait_ms_;
  double peak_memory_ = -1.0;  // the largest StepResult::peak_memory_bytes recorded
  std::vector<StepAttribution> attribution_;
  std::optional<double> energy_j_ = 0.0;  // summed over the recorded steps; nullopt once a reading failed
  Trace last_;
};

}  // namespace twobp
