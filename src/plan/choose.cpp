#include "twobp/plan/choose.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "util/check.h"
#include "util/reduce.h"

namespace twobp {

namespace {

const char* mode_label(BackwardMode mode) { return mode == BackwardMode::kSplit ? "2BP" : "standard"; }

std::string describe(const Schedule& s) { return fmt::format("{} {}", s.name, mode_label(s.backward)); }

bool all_positive(const std::vector<double>& v) {
  return !v.empty() && std::all_of(v.begin(), v.end(), [](double x) { return x > 0.0; });
}

// The simulator's costs of a `mode` form of the measured placement (MeasuredCosts::cost_model), or nullopt when
// the measurement cannot tell them: 2BP forms need I and W on every stage; a standard form's fused B is the
// measured one where the run had it, else I + W (throws UsageError, as cost_model, on lists of other sizes).
std::optional<CostModel> candidate_costs(const MeasuredCosts& m, BackwardMode mode) {
  if (mode == BackwardMode::kSplit) {
    if (!all_positive(m.backward_input)) return std::nullopt;
    return m.cost_model(BackwardMode::kSplit);
  }
  MeasuredCosts fused = m;
  if (fused.backward.size() == fused.backward_input.size() && fused.backward.size() == fused.backward_weight.size()) {
    for (std::size_t s = 0; s < fused.backward.size(); ++s) {
      if (fused.backward[s] <= 0.0) fused.backward[s] = fused.backward_input[s] + fused.backward_weight[s];
    }
  }
  if (!all_positive(fused.backward)) return std::nullopt;
  return fused.cost_model(BackwardMode::kStandard);
}

}  // namespace

std::vector<ScheduleCandidate> rank_schedules(const Schedule& running, const MeasuredCosts& costs,
                                              const RankOptions& options) {
  TWOBP_CHECK(running.num_ranks > 0 && running.num_stages == costs.num_stages(), UsageError,
              "rank_schedules: the costs are of {} stages, schedule '{}' has {}", costs.num_stages(), running.name,
              running.num_stages);
  TWOBP_CHECK(options.memory_limit_bytes <= 0.0 || options.memory != nullptr, UsageError,
              "rank_schedules: a memory limit ({} bytes) needs the measured memory model (RankOptions::memory: "
              "MemoryRecorder, agree_memory)",
              options.memory_limit_bytes);
  std::vector<std::pair<BackwardMode, CostModel>> models;  // the modes the costs can tell, once each
  for (BackwardMode mode : options.modes) {
    if (std::optional<CostModel> model = candidate_costs(costs, mode)) models.emplace_back(mode, std::move(*model));
  }
  std::vector<ScheduleCandidate> out;
  for (const std::string& name : options.names.empty() ? schedule_names() : options.names) {
    for (const auto& [mode, model] : models) {
      ScheduleCandidate c{name, mode, {}, 0.0, 0.0};
      try {
        c.schedule = make_schedule(
            name, ScheduleOptions{running.num_ranks, running.num_micro_batches, running.num_stages / running.num_ranks,
                                  mode});
      } catch (const UsageError&) {  // ScheduleError too: a shape this generator does not take
        continue;
      }
      if (c.schedule.stage_to_rank != running.stage_to_rank ||
          c.schedule.num_micro_batches != running.num_micro_batches) {
        continue;
      }
      if (options.memory != nullptr) {
        const std::vector<double> peaks = simulate_peak_memory(c.schedule, *options.memory);
        c.predicted_peak_bytes = *std::max_element(peaks.begin(), peaks.end());
        if (options.memory_limit_bytes > 0.0 && c.predicted_peak_bytes > options.memory_limit_bytes) continue;
      }
      c.predicted_ms = simulate(c.schedule, model).step_time;
      out.push_back(std::move(c));
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const ScheduleCandidate& a, const ScheduleCandidate& b) {
    return a.predicted_ms < b.predicted_ms;
  });
  return out;
}

AutoSchedule::AutoSchedule(Pipeline& pipeline, AutoScheduleOptions options)
    : pipeline_(pipeline),
      options_(std::move(options)),
      start_(pipeline.schedule()),
      costs_(pipeline.schedule().num_stages) {
  const int rank = pipeline.rank();
  TWOBP_CHECK(options_.probe_steps >= 2 && options_.verify_steps >= 2, UsageError,
              "rank {}: AutoScheduleOptions: probe_steps and verify_steps must be >= 2 (the first step of each is "
              "warm-up), got {} and {}",
              rank, options_.probe_steps, options_.verify_steps);
  const PipelineOptions& po = pipeline.options();
  TWOBP_CHECK(po.memory_limit_bytes == 0 && po.max_pending_weight_micro_batches == 0, UsageError,
              "rank {}: AutoSchedule ranks schedules by time only, and this pipeline bounds memory "
              "(memory_limit_bytes {}, max_pending_weight_micro_batches {}); choose the schedule yourself "
              "(twobp_bench plan / simulate predict time and memory)",
              rank, po.memory_limit_bytes, po.max_pending_weight_micro_batches);
  TWOBP_CHECK(options_.memory_limit_bytes >= 0.0, UsageError,
              "rank {}: AutoScheduleOptions::memory_limit_bytes must be >= 0 (0: no limit), got {}", rank,
              options_.memory_limit_bytes);
  if (options_.memory_limit_bytes > 0.0) {
    TWOBP_CHECK(po.record_memory, UsageError,
                "rank {}: AutoScheduleOptions::memory_limit_bytes needs the candidates' memory, measured per action: "
                "run the pipeline with PipelineOptions::record_memory = true",
                rank);
    memory_.emplace(pipeline.schedule().num_stages, stage_gradient_bytes(pipeline));
  }
}

double AutoSchedule::slowest_median_ms() {
  const double mine = step_ms_.empty() ? 0.0 : metrics::quantile(step_ms_, 0.5);
  double slowest = detail::max_over_ranks(pipeline_.transport(), mine, options_.timeout);
  if (options_.replicas != nullptr) slowest = detail::max_over_ranks(*options_.replicas, slowest, options_.timeout);
  return slowest;
}

std::optional<std::string> AutoSchedule::after_step(const StepResult& result) {
  if (phase_ == Phase::kDone) return std::nullopt;
  ++steps_in_phase_;
  if (steps_in_phase_ > 1) {  // the first step of a phase is warm-up
    if (phase_ == Phase::kProbing) {
      costs_.add(result.trace);
      if (memory_) memory_->add(result.trace);
    }
    step_ms_.push_back(result.pipeline_us / 1000.0);
  }
  if (phase_ == Phase::kProbing && steps_in_phase_ == options_.probe_steps) {
    start_ms_ = slowest_median_ms();
    const MeasuredCosts agreed =
        agree_costs(pipeline_.transport(), costs_.local_medians(), options_.timeout, options_.replicas);
    RankOptions ro;
    ro.names = options_.names;
    ro.modes = options_.modes;
    std::optional<MemoryModel> memory;
    if (memory_) {
      Transport& t = pipeline_.transport();
      memory = agree_memory(t, memory_->local_medians(t.rank(), t.world_size()), options_.timeout,
                            options_.replicas);
      ro.memory = &*memory;
      ro.memory_limit_bytes = options_.memory_limit_bytes;
    }
    ranking_ = rank_schedules(start_, agreed, ro);
    const std::optional<CostModel> own = candidate_costs(agreed, start_.backward);
    const double start_predicted = own ? simulate(start_, *own).step_time : 0.0;
    phase_ = Phase::kDone;
    if (ranking_.empty() || ranking_.front().predicted_ms >= start_predicted) {
      return fmt::format("auto schedule: keeping {} ({:.2f} ms/step measured, {:.2f} predicted; no candidate of "
                         "this placement{} is predicted faster)",
                         describe(start_), start_ms_, start_predicted,
                         memory_ ? fmt::format(" within {:.4g} MiB", options_.memory_limit_bytes / (1 << 20)) : "");
    }
    const ScheduleCandidate& best = ranking_.front();
    pipeline_.switch_schedule(best.schedule);
    phase_ = Phase::kVerifying;
    steps_in_phase_ = 0;
    step_ms_.clear();
    return fmt::format("auto schedule: {} measured {:.2f} ms/step (predicted {:.2f}); switching to {} (predicted "
                       "{:.2f}, {:.2f}x{}), the fastest of {} candidates of this placement{}",
                       describe(start_), start_ms_, start_predicted, describe(best.schedule), best.predicted_ms,
                       start_predicted / best.predicted_ms,
                       memory_ ? fmt::format(", peak {:.4g} MiB", best.predicted_peak_bytes / (1 << 20)) : "",
                       ranking_.size(),
                       memory_ ? fmt::format(" within {:.4g} MiB", options_.memory_limit_bytes / (1 << 20)) : "");
  }
  if (phase_ == Phase::kVerifying && steps_in_phase_ == options_.verify_steps) {
    chosen_ms_ = slowest_median_ms();
    phase_ = Phase::kDone;
    const std::string chosen = describe(pipeline_.schedule());
    if (chosen_ms_ > start_ms_) {
      pipeline_.switch_schedule(start_);
      return fmt::format("auto schedule: {} measured {:.2f} ms/step, slower than {}'s {:.2f}: back to {}", chosen,
                         chosen_ms_, describe(start_), start_ms_, describe(start_));
    }
    return fmt::format("auto schedule: keeping {}: {:.2f} ms/step measured against {:.2f} for {} ({:.2f}x)", chosen,
                       chosen_ms_, start_ms_, describe(start_), start_ms_ / chosen_ms_);
  }
  return std::nullopt;
}

}  // namespace twobp
