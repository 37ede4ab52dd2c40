#include "twobp/plan/choose.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"

namespace twobp {

namespace {

// "1f1b 2bp", "... with recomputation" (every rank), "... with recomputation on rank 3" / "on ranks 0-2,5".
std::string describe(const Schedule& s, const std::vector<int>& recompute_ranks = {}) {
  if (recompute_ranks.empty()) return fmt::format("{} {}", s.name, to_string(s.backward));
  const int n = static_cast<int>(recompute_ranks.size());
  return fmt::format("{} {} with recomputation{}", s.name, to_string(s.backward),
                     n == s.num_ranks ? ""
                     : n == 1         ? fmt::format(" on rank {}", recompute_ranks.front())
                                      : fmt::format(" on ranks {}", format_ranks(recompute_ranks)));
}
std::string describe(const ScheduleCandidate& c) { return describe(c.schedule, c.recompute_ranks); }

bool same_form(const ScheduleCandidate& a, const ScheduleCandidate& b) {
  return a.name == b.name && a.mode == b.mode && a.recompute_ranks == b.recompute_ranks;
}

// Per stage, `recomputing`'s entry where the stage's rank is in `ranks`, else `as_built`'s (a list left empty by
// both stays empty; one left empty by one side reads as 0 per stage there).
std::vector<double> per_stage(const std::vector<double>& as_built, const std::vector<double>& recomputing,
                              const std::vector<int>& stage_to_rank, const std::vector<int>& ranks) {
  if (as_built.empty() && recomputing.empty()) return {};
  std::vector<double> out(stage_to_rank.size(), 0.0);
  for (const std::vector<double>* v : {&as_built, &recomputing}) {
    TWOBP_CHECK(v->empty() || v->size() == out.size(), UsageError,
                "rank_schedules: a list of costs has {} entries, the schedule {} stages (one per stage)", v->size(),
                out.size());
  }
  for (std::size_t s = 0; s < out.size(); ++s) {
    const std::vector<double>& from = has_rank(ranks, stage_to_rank[s]) ? recomputing : as_built;
    if (!from.empty()) out[s] = from.at(s);
  }
  return out;
}

// The costs of a run whose ranks `ranks` recompute every stage (ScheduleCandidate::recompute_ranks): each stage's
// measured with its rank's setting.
MeasuredCosts mixed_costs(const MeasuredCosts& as_built, const MeasuredCosts& recomputing,
                          const std::vector<int>& stage_to_rank, const std::vector<int>& ranks) {
  MeasuredCosts c;
  c.forward = per_stage(as_built.forward, recomputing.forward, stage_to_rank, ranks);
  c.backward_input = per_stage(as_built.backward_input, recomputing.backward_input, stage_to_rank, ranks);
  c.backward_weight = per_stage(as_built.backward_weight, recomputing.backward_weight, stage_to_rank, ranks);
  c.backward_weight_fixed =
      per_stage(as_built.backward_weight_fixed, recomputing.backward_weight_fixed, stage_to_rank, ranks);
  c.backward = per_stage(as_built.backward, recomputing.backward, stage_to_rank, ranks);
  c.recompute = per_stage(as_built.recompute, recomputing.recompute, stage_to_rank, ranks);
  c.communication = std::max(as_built.communication, recomputing.communication);
  // Overlapped pairs hide as much with recomputation (inside the I or B) as without: the setting that measured more.
  const MeasuredCosts& pairs = as_built.overlapped_pairs >= recomputing.overlapped_pairs ? as_built : recomputing;
  c.overlap = pairs.overlap;
  c.overlapped_pairs = pairs.overlapped_pairs;
  auto none = [](const std::vector<double>& v) {
    return std::none_of(v.begin(), v.end(), [](double x) { return x > 0.0; });
  };
  if (none(c.recompute)) c.recompute.clear();
  if (none(c.backward_weight_fixed)) c.backward_weight_fixed.clear();
  return c;
}

// The memory model of the same run: each rank's base and each stage's actions and gradients from its setting.
MemoryModel mixed_memory(const MemoryModel& as_built, const MemoryModel& recomputing,
                         const std::vector<int>& stage_to_rank, const std::vector<int>& ranks) {
  TWOBP_CHECK(recomputing.base.size() == as_built.base.size() && recomputing.stages.size() == as_built.stages.size(),
              UsageError,
              "rank_schedules: the recomputing memory model covers {} ranks and {} stages, the other {} and {}",
              recomputing.base.size(), recomputing.stages.size(), as_built.base.size(), as_built.stages.size());
  MemoryModel m = as_built;
  for (int r : ranks) m.base.at(r) = recomputing.base.at(r);
  for (std::size_t s = 0; s < m.stages.size(); ++s) {
    if (!has_rank(ranks, stage_to_rank.at(s))) continue;
    m.stages[s] = recomputing.stages.at(s);
    if (recomputing.gradients.size() == m.gradients.size()) m.gradients[s] = recomputing.gradients[s];
  }
  return m;
}

double max_peak(const Schedule& schedule, const MemoryModel& memory) {
  const std::vector<double> peaks = simulate_peak_memory(schedule, memory);
  return *std::max_element(peaks.begin(), peaks.end());
}

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
    CostModel parts;  // the split parts, for CostModel::unfused_backward
    parts.backward_input = m.backward_input;
    parts.backward_weight = m.backward_weight;
    if (m.backward_weight_fixed.size() == m.backward_weight.size()) {
      parts.backward_weight_fixed = m.backward_weight_fixed;
    }
    for (std::size_t s = 0; s < fused.backward.size(); ++s) {
      if (fused.backward[s] <= 0.0) fused.backward[s] = parts.unfused_backward(static_cast<int>(s));
    }
  }
  if (!all_positive(fused.backward)) return std::nullopt;
  return fused.cost_model(BackwardMode::kStandard);
}

// The candidate set is refused, not silently narrowed: an unknown name (a typo) or no mode at all would otherwise
// leave no candidate and read as "no candidate predicted faster". UsageError naming `who`, the value and the
// known names.
void check_candidate_set(const std::vector<std::string>& names, const std::vector<BackwardMode>& modes,
                         const std::string& who) {
  TWOBP_CHECK(!modes.empty(), UsageError,
              "{}: the set of backward modes is empty, so no schedule could be a candidate; give at least one "
              "(standard, 2bp), or leave the default (both)",
              who);
  const std::vector<std::string> known = schedule_names();
  for (const std::string& name : names) {
    TWOBP_CHECK(std::find(known.begin(), known.end(), name) != known.end(), UsageError,
                "{}: '{}' is not a registered schedule (known: {}); leave the names empty for every registered one",
                who, name, fmt::join(known, ", "));
  }
}

// Fastest predicted first; exact ties in registry order (schedule_names(), whatever order RankOptions::names gave),
// standard before 2BP, then fewer recomputing ranks, as choose.h promises.
void sort_candidates(std::vector<ScheduleCandidate>& out) {
  const std::vector<std::string> registry = schedule_names();
  auto registered = [&](const std::string& name) { return std::find(registry.begin(), registry.end(), name); };
  std::stable_sort(out.begin(), out.end(), [&](const ScheduleCandidate& a, const ScheduleCandidate& b) {
    if (a.predicted_ms != b.predicted_ms) return a.predicted_ms < b.predicted_ms;
    if (a.name != b.name) return registered(a.name) < registered(b.name);
    if (a.mode != b.mode) return a.mode == BackwardMode::kStandard;
    return a.recompute_ranks.size() < b.recompute_ranks.size();
  });
}

}  // namespace

std::vector<ScheduleCandidate> rank_schedules(const Schedule& running, const MeasuredCosts& costs,
                                              const RankOptions& options) {
  TWOBP_CHECK(running.num_ranks > 0 && running.num_stages == costs.num_stages(), UsageError,
              "rank_schedules: the costs are of {} stages, schedule '{}' has {}", costs.num_stages(), running.name,
              running.num_stages);
  check_candidate_set(options.names, options.modes, "rank_schedules: RankOptions");
  check_measured_costs(costs, "rank_schedules: costs");
  if (options.recompute_costs != nullptr) {
    check_measured_costs(*options.recompute_costs, "rank_schedules: RankOptions.recompute_costs");
  }
  TWOBP_CHECK(!std::isnan(options.memory_limit_bytes), UsageError,
              "rank_schedules: RankOptions.memory_limit_bytes is nan, expected a size in bytes (<= 0: no limit)");
  TWOBP_CHECK(options.memory_limit_bytes <= 0.0 || options.memory != nullptr, UsageError,
              "rank_schedules: a memory limit ({} bytes) needs the measured memory model (RankOptions::memory: "
              "MemoryRecorder, agree_memory)",
              options.memory_limit_bytes);
  const MeasuredCosts* recomputing = options.recompute_costs;
  TWOBP_CHECK(recomputing == nullptr || recomputing->num_stages() == running.num_stages, UsageError,
              "rank_schedules: the recomputing costs are of {} stages, schedule '{}' has {}",
              recomputing == nullptr ? 0 : recomputing->num_stages(), running.name, running.num_stages);
  TWOBP_CHECK(recomputing == nullptr || options.memory == nullptr || options.recompute_memory != nullptr, UsageError,
              "rank_schedules: with a memory model and recomputing costs, the recomputing forms need their memory "
              "model too (RankOptions::recompute_memory)");
  // Per set of recomputing ranks, built when a form first asks for it: the costs of the modes they can tell, once
  // each, and the memory model.
  struct Setting {
    std::vector<std::pair<BackwardMode, CostModel>> models;
    std::optional<MemoryModel> memory;
  };
  std::map<std::vector<int>, Setting> settings;
  auto setting_of = [&](const std::vector<int>& ranks) -> const Setting& {
    if (auto known = settings.find(ranks); known != settings.end()) return known->second;
    Setting setting;
    const MeasuredCosts measured =
        ranks.empty() ? costs : mixed_costs(costs, *recomputing, running.stage_to_rank, ranks);
    for (BackwardMode mode : options.modes) {
      if (std::optional<CostModel> model = candidate_costs(measured, mode)) {
        setting.models.emplace_back(mode, std::move(*model));
      }
    }
    if (options.memory != nullptr) {
      setting.memory = ranks.empty()
                           ? *options.memory
                           : mixed_memory(*options.memory, *options.recompute_memory, running.stage_to_rank, ranks);
    }
    return settings.emplace(ranks, std::move(setting)).first->second;
  };
  std::vector<ScheduleCandidate> out;
  for (const std::string& name : options.names.empty() ? schedule_names() : options.names) {
    for (BackwardMode mode : options.modes) {
      Schedule schedule;
      try {
        // synth is synthesized for this mode's measured costs (every stage as built), not the textbook ones.
        schedule = make_schedule_for_costs(
            name, ScheduleOptions{running.num_ranks, running.num_micro_batches, running.num_stages / running.num_ranks,
                                  mode},
            [&setting_of, mode = mode](const std::vector<int>&) {
              const auto& models = setting_of({}).models;
              const auto it = std::find_if(models.begin(), models.end(), [&](const auto& m) { return m.first == mode; });
              if (it == models.end()) throw UsageError("the measured costs cannot tell this mode's form");
              return it->second;
            },
            options.synthesis, running.stage_to_rank);
      } catch (const UsageError&) {  // ScheduleError too: a shape this generator does not take
        continue;
      }
      if (schedule.stage_to_rank != running.stage_to_rank || schedule.num_micro_batches != running.num_micro_batches) {
        continue;
      }
      // Every stage as built, then the first 1 .. num_ranks ranks of recompute_order by this form's peaks.
      std::vector<std::vector<int>> recomputing_sets{{}};
      if (recomputing != nullptr) {
        const std::vector<int> order = recompute_order(
            options.memory != nullptr ? simulate_peak_memory(schedule, *options.memory) : std::vector<double>{},
            running.num_ranks);
        for (int j = 1; j <= running.num_ranks; ++j) recomputing_sets.push_back(first_ranks_of(order, j));
      }
      for (const std::vector<int>& ranks : recomputing_sets) {
        const Setting& setting = setting_of(ranks);
        const auto model = std::find_if(setting.models.begin(), setting.models.end(),
                                        [mode = mode](const auto& m) { return m.first == mode; });
        if (model == setting.models.end()) continue;  // the costs cannot tell this mode
        ScheduleCandidate c{name, mode, schedule, 0.0, 0.0, ranks};
        if (setting.memory) {
          c.predicted_peak_bytes = max_peak(c.schedule, *setting.memory);
          if (options.memory_limit_bytes > 0.0 && c.predicted_peak_bytes > options.memory_limit_bytes) continue;
        }
        c.predicted_ms = simulate(c.schedule, model->second).step_time;
        out.push_back(std::move(c));
      }
    }
  }
  sort_candidates(out);
  return out;
}

AutoSchedule::AutoSchedule(Pipeline& pipeline, AutoScheduleOptions options)
    : pipeline_(pipeline),
      options_(std::move(options)),
      trial_(pipeline.transport(), options_.replicas, options_.timeout),
      start_(pipeline.schedule()) {
  const int rank = pipeline.rank();
  TWOBP_CHECK(options_.probe_steps >= 2 && options_.verify_steps >= 2, UsageError,
              "rank {}: AutoScheduleOptions: probe_steps and verify_steps must be >= 2 (the first step of each is "
              "warm-up), got {} and {}",
              rank, options_.probe_steps, options_.verify_steps);
  TWOBP_CHECK(options_.measure_candidates >= 1 && options_.measure_within >= 0.0, UsageError,
              "rank {}: AutoScheduleOptions: measure_candidates must be >= 1 and measure_within >= 0, got {} and {}",
              rank, options_.measure_candidates, options_.measure_within);
  check_candidate_set(options_.names, options_.modes, fmt::format("rank {}: AutoScheduleOptions", rank));
  const ExecutorOptions& po = pipeline.options().executor;
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
                "run the pipeline with PipelineOptions::executor.record_memory = true",
                rank);
  }
  const int settings = options_.recompute ? 2 : 1;  // as built, and with every stage recomputing
  for (int k = 0; k < settings; ++k) {
    costs_.emplace_back(start_.num_stages);
    if (options_.memory_limit_bytes > 0.0) memory_.emplace_back(start_.num_stages, stage_gradient_bytes(pipeline));
  }
  for (int s : pipeline.stage_indices()) built_recompute_.emplace_back(s, pipeline.stage(s).options().recompute);
  // The starting schedule, then its other form where the candidates include that mode: a 2BP run measures I and
  // W but not what a fused B costs (less than I + W), a standard run B but not I and W. With recompute, both again
  // with every stage recomputing.
  probes_.push_back(ScheduleCandidate{start_.name, start_.backward, start_, 0.0, 0.0, {}});
  const BackwardMode other =
      start_.backward == BackwardMode::kSplit ? BackwardMode::kStandard : BackwardMode::kSplit;
  if (std::find(options_.modes.begin(), options_.modes.end(), other) != options_.modes.end()) {
    try {
      Schedule form = make_schedule(
          start_.name, ScheduleOptions{start_.num_ranks, start_.num_micro_batches, start_.num_stages / start_.num_ranks,
                                       other});
      if (form.stage_to_rank == start_.stage_to_rank && form.num_micro_batches == start_.num_micro_batches) {
        probes_.push_back(ScheduleCandidate{form.name, form.backward, std::move(form), 0.0, 0.0, {}});
      }
    } catch (const UsageError&) {  // a schedule from a file, or a generator without that form
    }
  }
  if (options_.probe_weight_sizes) {
    for (std::size_t k = 0; k < probes_.size(); ++k) {
      if (probes_[k].mode != BackwardMode::kSplit) continue;
      Schedule single = one_micro_batch_per_weight(probes_[k].schedule);
      if (single.name == probes_[k].schedule.name) break;  // its W's are one micro-batch each already
      weight_probe_ = k + 1;                               // measured right after the 2BP form
      std::string name = single.name;
      probes_.insert(probes_.begin() + static_cast<std::ptrdiff_t>(weight_probe_),
                     ScheduleCandidate{std::move(name), BackwardMode::kSplit, std::move(single), 0.0, 0.0, {}});
      break;
    }
  }
  if (options_.recompute) {
    const std::size_t built = probes_.size();
    for (std::size_t k = 0; k < built; ++k) {
      if (k == weight_probe_) continue;
      probes_.push_back(probes_[k]);
      probes_.back().recompute_ranks = recomputing_ranks(true, 0, "", start_.num_ranks);  // every rank
    }
  }
  trial_.start(options_.probe_steps);
}

std::optional<std::string> AutoSchedule::after_step(const StepResult& result) {
  if (phase_ == Phase::kDone) return std::nullopt;
  if (trial_.add(result.pipeline_us / 1000.0) && phase_ == Phase::kProbing) {  // the first step is warm-up
    const int setting = probes_[probe_ms_.size()].recompute_ranks.empty() ? 0 : 1;
    costs_[setting].add(result.trace);
    if (!memory_.empty()) memory_[setting].add(result.trace);
  }
  if (!trial_.complete()) return std::nullopt;
  if (phase_ == Phase::kProbing) {
    probe_ms_.push_back(trial_.finish());
    if (probe_ms_.size() < probes_.size()) {
      const ScheduleCandidate& measured = probes_[probe_ms_.size() - 1];
      const ScheduleCandidate& next = probes_[probe_ms_.size()];
      start_phase(next);
      std::string why;
      if (probe_ms_.size() == weight_probe_) {
        why = "its W's one micro-batch at a time too (W's in two sizes: their fixed part)";
      } else if (next.recompute_ranks != measured.recompute_ranks) {
        why = "with every stage recomputing too (what recomputation costs and saves)";
      } else {
        why = fmt::format("its {} form too (what {} costs)", to_string(next.mode),
                          next.mode == BackwardMode::kSplit ? "an I and a W" : "a fused B");
      }
      return fmt::format("auto schedule: {} measured {:.2f} ms/step; measuring {}; switching to {}", describe(measured),
                         probe_ms_.back(), why, describe(next));
    }
    return end_probe();
  }
  return end_trial();
}

std::string AutoSchedule::memory_note() const {
  return memory_.empty() ? "" : fmt::format(" within {:.4g} MiB", options_.memory_limit_bytes / (1 << 20));
}

void AutoSchedule::set_recompute(const std::vector<int>& ranks) {
  const bool mine = has_rank(ranks, pipeline_.rank());
  for (const auto& [stage, built] : built_recompute_) pipeline_.stage(stage).set_recompute(mine || built);
  recompute_ranks_ = ranks;
}

void AutoSchedule::start_phase(const ScheduleCandidate& next) {
  set_recompute(next.recompute_ranks);
  pipeline_.switch_schedule(next.schedule);
  trial_.start(phase_ == Phase::kProbing ? options_.probe_steps : options_.verify_steps);
}

std::string AutoSchedule::end_probe() {
  // Per recomputation setting probed (as built; every stage recomputing): the agreed costs and memory model.
  Transport& t = pipeline_.transport();
  std::vector<MeasuredCosts> agreed;
  std::vector<MemoryModel> memory;
  for (std::size_t k = 0; k < costs_.size(); ++k) {
    agreed.push_back(agree_costs(t, costs_[k].local_medians(), options_.timeout, options_.replicas));
    if (!memory_.empty()) {
      memory.push_back(
          agree_memory(t, memory_[k].local_medians(t.rank(), t.world_size()), options_.timeout, options_.replicas));
    }
  }
  // Every candidate, each recompute_ranks setting's stages costed (and their memory modelled) from the probes of
  // their ranks' setting.
  RankOptions ro;
  ro.names = options_.names;
  ro.modes = options_.modes;
  if (!memory.empty()) {
    ro.memory = &memory[0];
    ro.memory_limit_bytes = options_.memory_limit_bytes;
  }
  if (agreed.size() > 1) {
    ro.recompute_costs = &agreed[1];
    if (!memory.empty()) ro.recompute_memory = &memory[1];
  }
  ranking_ = rank_schedules(start_, agreed[0], ro);
  measured_ = agreed[0];
  // The probes' predictions; a probed form is kept only if it fits the limit (see settle() for the start).
  probe_fits_.assign(probes_.size(), true);
  for (std::size_t k = 0; k < probes_.size(); ++k) {
    ScheduleCandidate& p = probes_[k];
    const int setting = p.recompute_ranks.empty() ? 0 : 1;
    const std::optional<CostModel> model = candidate_costs(agreed[setting], p.mode);
    p.predicted_ms = model ? simulate(p.schedule, *model).step_time : 0.0;
    if (!memory.empty()) {
      p.predicted_peak_bytes = max_peak(p.schedule, memory[setting]);
      probe_fits_[k] = p.predicted_peak_bytes <= options_.memory_limit_bytes;
    }
  }
  const double start_predicted = probes_.front().predicted_ms;
  // The shortlist: the fastest predictions not measured yet, within `measure_within` of the best of them and of the
  // starting schedule's prediction (the simulator cannot tell closer ones apart reliably).
  double best = probe_fits_.front() ? start_predicted : std::numeric_limits<double>::infinity();
  if (!ranking_.empty()) best = std::min(best, ranking_.front().predicted_ms);
  const double bar = best * (1.0 + options_.measure_within);
  for (const ScheduleCandidate& c : ranking_) {
    if (static_cast<int>(trials_.size()) == options_.measure_candidates || c.predicted_ms > bar) break;
    const bool probed =
        std::any_of(probes_.begin(), probes_.end(), [&](const ScheduleCandidate& p) { return same_form(c, p); });
    if (!probed) trials_.push_back(c);
  }
  const ScheduleCandidate& last = probes_[probe_ms_.size() - 1];
  const std::string probed = fmt::format("auto schedule: {} {}", describe(last),
                                         measured_against_prediction(probe_ms_.back(), last.predicted_ms));
  if (trials_.empty()) {
    return settle(fmt::format("{}; no other candidate of this placement{} is predicted faster or within {:.0f} % of "
                              "it",
                              probed, memory_note(), 100 * options_.measure_within));
  }
  std::vector<std::string> listed;
  for (const ScheduleCandidate& c : trials_) {
    const std::string peak =
        memory_.empty() ? "" : fmt::format(", peak {:.4g} MiB", c.predicted_peak_bytes / (1 << 20));
    listed.push_back(fmt::format("{} ({:.2f}{})", describe(c), c.predicted_ms, peak));
  }
  phase_ = Phase::kVerifying;
  start_phase(trials_.front());
  return fmt::format("{}; measuring the {} of {} candidates of this placement{} predicted fastest: {}; switching to {}",
                     probed, trials_.size(), ranking_.size(), memory_note(), fmt::join(listed, ", "),
                     describe(trials_.front()));
}

std::string AutoSchedule::end_trial() {
  const ScheduleCandidate& tried = trials_[trial_ms_.size()];
  trial_ms_.push_back(trial_.finish());
  const std::string measured = fmt::format("auto schedule: {} {}", describe(tried),
                                           measured_against_prediction(trial_ms_.back(), tried.predicted_ms));
  if (trial_ms_.size() < trials_.size()) {
    const ScheduleCandidate& next = trials_[trial_ms_.size()];
    start_phase(next);
    return fmt::format("{}; switching to {}", measured, describe(next));
  }
  return settle(measured);
}

std::string AutoSchedule::settle(const std::string& prefix) {
  // Every form measured -- the probed ones, then the trials -- by the same slowest-rank medians.
  std::vector<std::pair<const ScheduleCandidate*, double>> all;
  for (std::size_t k = 0; k < probes_.size(); ++k) {
    if (probe_fits_[k] && k != weight_probe_) all.emplace_back(&probes_[k], probe_ms_[k]);  // that one only measures
  }
  for (std::size_t k = 0; k < trials_.size(); ++k) all.emplace_back(&trials_[k], trial_ms_[k]);
  // Nothing measured fits the memory limit: the job goes on with the starting schedule, over the limit.
  const bool over_limit = all.empty();
  if (over_limit) all.emplace_back(&probes_.front(), probe_ms_.front());
  std::vector<double> ms;
  for (const auto& measured : all) ms.push_back(measured.second);
  const auto& best = all[fastest(ms)];  // ties: the first measured (the starting schedule first)
  phase_ = Phase::kDone;
  chosen_ms_ = best.second;
  const ScheduleCandidate& chosen = *best.first;
  const Schedule& now = pipeline_.schedule();
  const bool running =
      chosen.name == now.name && chosen.mode == now.backward && chosen.recompute_ranks == recompute_ranks_;
  if (!running) {
    set_recompute(chosen.recompute_ranks);
    pipeline_.switch_schedule(chosen.schedule);
  }
  const std::string verb = running ? "keeping" : &chosen == &probes_.front() ? "back to" : "switching to";
  const ScheduleCandidate& first = probes_.front();
  if (over_limit) {
    return fmt::format("{}; nothing measured fits{}: {} {}, the starting schedule (predicted peak {:.4g} MiB)", prefix,
                       memory_note(), verb, describe(chosen), first.predicted_peak_bytes / (1 << 20));
  }
  const std::string start_over =
      probe_fits_.front() ? ""
                          : fmt::format(" (the starting schedule's predicted peak, {:.4g} MiB, is over the limit)",
                                        first.predicted_peak_bytes / (1 << 20));
  if (all.size() == 1) return fmt::format("{}; {} {}{}", prefix, verb, describe(chosen), start_over);
  return fmt::format("{}; {} {}: {:.2f} ms/step measured against {:.2f} for {} ({:.2f}x), the fastest of {} "
                     "measured{}",
                     prefix, verb, describe(chosen), chosen_ms_, starting_ms(), describe(start_),
                     starting_ms() / chosen_ms_, all.size(), start_over);
}

}  // namespace twobp
