#include "twobp/plan/choose.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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
  TWOBP_CHECK(options_.measure_candidates >= 1 && options_.measure_within >= 0.0, UsageError,
              "rank {}: AutoScheduleOptions: measure_candidates must be >= 1 and measure_within >= 0, got {} and {}",
              rank, options_.measure_candidates, options_.measure_within);
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
  // The starting schedule, then its other form where the candidates include that mode: a 2BP run measures I and
  // W but not what a fused B costs (less than I + W), a standard run B but not I and W.
  probes_.push_back(start_);
  const BackwardMode other =
      start_.backward == BackwardMode::kSplit ? BackwardMode::kStandard : BackwardMode::kSplit;
  if (std::find(options_.modes.begin(), options_.modes.end(), other) != options_.modes.end()) {
    try {
      Schedule form = make_schedule(
          start_.name, ScheduleOptions{start_.num_ranks, start_.num_micro_batches, start_.num_stages / start_.num_ranks,
                                       other});
      if (form.stage_to_rank == start_.stage_to_rank && form.num_micro_batches == start_.num_micro_batches) {
        probes_.push_back(std::move(form));
      }
    } catch (const UsageError&) {  // a schedule from a file, or a generator without that form
    }
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
    probe_ms_.push_back(slowest_median_ms());
    if (probe_ms_.size() < probes_.size()) {
      const Schedule& measured = probes_[probe_ms_.size() - 1];
      start_phase(probes_[probe_ms_.size()]);
      return fmt::format("auto schedule: {} measured {:.2f} ms/step; measuring its {} form too (what {} costs); "
                         "switching to {}",
                         describe(measured), probe_ms_.back(), mode_label(pipeline_.schedule().backward),
                         pipeline_.schedule().backward == BackwardMode::kSplit ? "an I and a W" : "a fused B",
                         describe(pipeline_.schedule()));
    }
    return end_probe();
  }
  if (phase_ == Phase::kVerifying && steps_in_phase_ == options_.verify_steps) return end_trial();
  return std::nullopt;
}

std::string AutoSchedule::memory_note() const {
  return memory_ ? fmt::format(" within {:.4g} MiB", options_.memory_limit_bytes / (1 << 20)) : "";
}

void AutoSchedule::start_phase(const Schedule& next) {
  pipeline_.switch_schedule(next);
  steps_in_phase_ = 0;
  step_ms_.clear();
}

std::string AutoSchedule::end_probe() {
  const MeasuredCosts agreed =
      agree_costs(pipeline_.transport(), costs_.local_medians(), options_.timeout, options_.replicas);
  RankOptions ro;
  ro.names = options_.names;
  ro.modes = options_.modes;
  std::optional<MemoryModel> memory;
  if (memory_) {
    Transport& t = pipeline_.transport();
    memory = agree_memory(t, memory_->local_medians(t.rank(), t.world_size()), options_.timeout, options_.replicas);
    ro.memory = &*memory;
    ro.memory_limit_bytes = options_.memory_limit_bytes;
  }
  // A probed form other than the starting schedule is kept only if it fits the limit too.
  probe_fits_.assign(probes_.size(), true);
  for (std::size_t k = 1; k < probes_.size() && memory; ++k) {
    const std::vector<double> peaks = simulate_peak_memory(probes_[k], *memory);
    probe_fits_[k] = *std::max_element(peaks.begin(), peaks.end()) <= options_.memory_limit_bytes;
  }
  ranking_ = rank_schedules(start_, agreed, ro);
  auto predicted = [&](const Schedule& s) {
    const std::optional<CostModel> model = candidate_costs(agreed, s.backward);
    return model ? simulate(s, *model).step_time : 0.0;
  };
  const double start_predicted = predicted(start_);
  // The shortlist: the fastest predictions not measured yet, within `measure_within` of the best of them and of the
  // starting schedule's prediction (the simulator cannot tell closer ones apart reliably).
  const double bar = (ranking_.empty() ? start_predicted : std::min(ranking_.front().predicted_ms, start_predicted)) *
                     (1.0 + options_.measure_within);
  for (const ScheduleCandidate& c : ranking_) {
    if (static_cast<int>(trials_.size()) == options_.measure_candidates || c.predicted_ms > bar) break;
    const bool probed = std::any_of(probes_.begin(), probes_.end(), [&](const Schedule& p) {
      return c.name == p.name && c.mode == p.backward;
    });
    if (!probed) trials_.push_back(c);
  }
  const std::string probed = fmt::format("auto schedule: {} measured {:.2f} ms/step (predicted {:.2f})",
                                         describe(pipeline_.schedule()), probe_ms_.back(),
                                         predicted(pipeline_.schedule()));
  if (trials_.empty()) {
    return settle(fmt::format("{}; no other candidate of this placement{} is predicted faster or within {:.0f} % of "
                              "it",
                              probed, memory_note(), 100 * options_.measure_within));
  }
  std::vector<std::string> listed;
  for (const ScheduleCandidate& c : trials_) {
    listed.push_back(fmt::format("{} ({:.2f}{})", describe(c.schedule), c.predicted_ms,
                                 memory_ ? fmt::format(", peak {:.4g} MiB", c.predicted_peak_bytes / (1 << 20)) : ""));
  }
  phase_ = Phase::kVerifying;
  start_phase(trials_.front().schedule);
  return fmt::format("{}; measuring the {} of {} candidates of this placement{} predicted fastest: {}; switching to {}",
                     probed, trials_.size(), ranking_.size(), memory_note(), fmt::join(listed, ", "),
                     describe(trials_.front().schedule));
}

std::string AutoSchedule::end_trial() {
  const ScheduleCandidate& tried = trials_[trial_ms_.size()];
  trial_ms_.push_back(slowest_median_ms());
  const std::string measured = fmt::format("auto schedule: {} measured {:.2f} ms/step (predicted {:.2f})",
                                           describe(tried.schedule), trial_ms_.back(), tried.predicted_ms);
  if (trial_ms_.size() < trials_.size()) {
    start_phase(trials_[trial_ms_.size()].schedule);
    return fmt::format("{}; switching to {}", measured, describe(pipeline_.schedule()));
  }
  return settle(measured);
}

std::string AutoSchedule::settle(const std::string& prefix) {
  // Every schedule measured -- the probed forms, then the trials -- by the same slowest-rank medians.
  std::vector<std::pair<const Schedule*, double>> all;
  for (std::size_t k = 0; k < probes_.size(); ++k) {
    if (probe_fits_[k]) all.emplace_back(&probes_[k], probe_ms_[k]);
  }
  for (std::size_t k = 0; k < trials_.size(); ++k) all.emplace_back(&trials_[k].schedule, trial_ms_[k]);
  const auto best = std::min_element(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.second < b.second;  // ties: the first measured (the starting schedule first)
  });
  phase_ = Phase::kDone;
  chosen_ms_ = best->second;
  const Schedule& chosen = *best->first;
  const bool running = chosen.name == pipeline_.schedule().name && chosen.backward == pipeline_.schedule().backward;
  if (!running) pipeline_.switch_schedule(chosen);
  const std::string verb = running ? "keeping" : best == all.begin() ? "back to" : "switching to";
  if (all.size() == 1) return fmt::format("{}; {} {}", prefix, verb, describe(chosen));
  return fmt::format("{}; {} {}: {:.2f} ms/step measured against {:.2f} for {} ({:.2f}x), the fastest of {} "
                     "measured",
                     prefix, verb, describe(chosen), chosen_ms_, starting_ms(), describe(start_),
                     starting_ms() / chosen_ms_, all.size());
}

}  // namespace twobp
