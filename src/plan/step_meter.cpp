#include "twobp/plan/step_meter.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/metrics.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"

namespace twobp {

StepMeter::StepMeter(Pipeline& pipeline, Transport& world, StepMeterOptions options)
    : pipeline_(pipeline), world_(world), options_(options), costs_(pipeline.schedule().num_stages) {
  if (pipeline.options().executor.record_memory) {
    memory_.emplace(pipeline.schedule().num_stages, stage_gradient_bytes(pipeline));
  }
}

void StepMeter::step(const NamedTensors& inputs, const NamedTensors& targets, bool record) {
  pipeline_.zero_grad();
  world_.barrier(options_.timeout);
  const auto t0 = std::chrono::steady_clock::now();
  const std::optional<double> e0 = options_.energy ? options_.energy->share() : std::nullopt;
  StepResult result = pipeline_.step(inputs, targets);
  world_.barrier(options_.timeout);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const std::optional<double> e1 = options_.energy ? options_.energy->share() : std::nullopt;
  if (!record) return;
  StepTimes times;
  times.pipeline_us = result.pipeline_us;
  times.reduce_wait_us = result.reduce_wait_us;
  times.step_us = us;
  add(std::move(result), times, e0 && e1 ? std::optional<double>(*e1 - *e0) : std::nullopt);
}

void StepMeter::add(StepResult result, const StepTimes& times, std::optional<double> energy_j) {
  const StepAttribution attribution = attribute_step(pipeline_.schedule(), result.trace, times);
  step_ms_.push_back(attribution.step_us / 1000.0);
  busy_ms_.push_back(result.trace.busy_us() / 1000.0);
  reduce_wait_ms_.push_back(result.reduce_wait_us / 1000.0);
  peak_memory_ = std::max(peak_memory_, static_cast<double>(result.peak_memory_bytes));
  energy_j_ = energy_j_ && energy_j ? std::optional<double>(*energy_j_ + *energy_j) : std::nullopt;
  attribution_.push_back(attribution);
  costs_.add(result.trace);  // I and B without their recomputation, recorded apart (the simulator adds it)
  if (memory_) memory_->add(result.trace);
  last_ = std::move(result.trace);
}

MeteredSteps StepMeter::summarize(ParallelGroups& groups) const {
  Transport& pipeline = groups.pipeline();
  const Duration timeout = options_.timeout;
  const int n = steps(), p = pipeline.world_size();
  TWOBP_CHECK(n > 0, UsageError, "StepMeter::summarize on rank {}: no step was recorded (record at least one)",
              world_.rank());
  MeteredSteps s;
  s.steps = n;
  s.costs = agree_costs(pipeline, costs_.local_medians(), timeout);
  // Every rank's busy time per step summed, rank 0's step times (the others add 0): one all-reduce.
  std::vector<double> local(2 * static_cast<std::size_t>(n), 0.0);
  for (int k = 0; k < n; ++k) {
    local[k] = busy_ms_[k];
    if (pipeline.rank() == 0) local[n + k] = step_ms_[k];
  }
  const std::vector<double> total = sum_over_ranks(pipeline, local, timeout);
  s.step_ms.assign(total.begin() + n, total.end());
  for (int k = 0; k < n; ++k) s.bubble.push_back(metrics::bubble_fraction(total[k], p, s.step_ms[k]));
  if (memory_) s.memory = compare_peak_memory(pipeline, pipeline_.schedule(), *memory_, peak_memory_, timeout);
  s.attribution = gather_attributions(pipeline, mean_attribution(attribution_), timeout);
  s.last_traces = gather_traces(pipeline, last_, timeout);
  const bool metered = options_.energy != nullptr;  // the same on every rank (one StepMeter per rank, alike)
  if (metered) {
    if (const std::optional<double> joules = energy::job_energy(world_, energy_j_, timeout)) s.energy_j = *joules / n;
  }
  if (groups.layout().dp > 1) {
    for (double wait : reduce_wait_ms_) {
      s.exposed_reduce_ms.push_back(metrics::exposed_wait(gather_over_ranks(world_, wait, timeout)));
    }
  }
  return s;
}

}  // namespace twobp
