#include "twobp/plan/placement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/units.h"
#include "twobp/plan/llama.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"

namespace twobp {

namespace {

bool every_stage(const std::vector<double>& ms) {
  return !ms.empty() && std::all_of(ms.begin(), ms.end(), [](double x) { return x > 0; });
}

// The planner's options for one replica of `current`'s ranks and micro-batches.
LayoutPlanOptions layout_options(const Placement& current, const PlacementPlanOptions& o) {
  LayoutPlanOptions lo;
  lo.ranks = current.schedule.num_ranks;
  lo.max_dp = 1;
  lo.seq = o.seq;
  lo.micro_batch_size = o.micro_batch_size;
  lo.global_batch = static_cast<int64_t>(current.schedule.num_micro_batches) * o.micro_batch_size;
  lo.recompute = o.recompute ? std::vector<bool>{false, true} : std::vector<bool>{false};
  lo.precision = models::training_precision(o.precision);
  lo.memory_limit_bytes = o.memory_limit_bytes;
  lo.communication_ms = o.communication_ms;
  return lo;
}

}  // namespace

bool same_placement(const Placement& a, const Placement& b) {
  return a.schedule.num_stages == b.schedule.num_stages && a.schedule.stage_to_rank == b.schedule.stage_to_rank &&
         a.partition.layout() == b.partition.layout();
}

std::string describe(const Placement& p) {
  std::string s = fmt::format("{} {} ({} chunk(s) per rank, layers {})", p.schedule.name,
                              to_string(p.schedule.backward), p.schedule.num_stages / p.schedule.num_ranks,
                              p.partition.layout());
  if (!p.recompute_ranks.empty()) s += fmt::format(" recomputing on ranks {}", fmt::join(p.recompute_ranks, ","));
  return s;
}

PlacementRanking rank_llama_placements(const models::LlamaConfig& config, const Placement& current,
                                       const MeasuredCosts& measured, const PlacementPlanOptions& options) {
  PlacementRanking out;
  if (!every_stage(measured.forward) || !every_stage(measured.backward_input) ||
      !every_stage(measured.backward_weight)) {
    out.why_none = "the probes did not measure F, I and W on every stage (a 2BP form that runs them all)";
    return out;
  }
  // The chunks: I and W from the 2BP probe, B from the standard one where that ran (fit_llama_costs).
  std::vector<MeasuredLlamaRun> runs{{current.partition, BackwardMode::kSplit, measured}};
  if (every_stage(measured.backward)) runs.push_back({current.partition, BackwardMode::kStandard, measured});
  const LlamaCosts costs = fit_llama_costs(config, options.seq, runs);
  const LayoutPlanOptions lo = layout_options(current, options);
  LayoutPlan plan;
  try {
    plan = plan_llama_layouts(config, costs, lo);
  } catch (const UsageError& e) {
    out.why_none = e.what();
    return out;
  }
  const Schedule& now = current.schedule;
  for (const LayoutCandidate& c : plan.candidates) {
    if (!c.fits) continue;
    Placement other;
    other.schedule = make_schedule(c.schedule, ScheduleOptions{now.num_ranks, now.num_micro_batches, c.v, c.mode});
    other.partition = models::make_partition(config, other.schedule.num_stages, options.seq);  // as the planner cut it
    other.recompute_ranks = c.recompute_ranks;
    if (!same_placement(other, current)) {
      out.others.push_back({std::move(other), c.step_ms});
    } else if (c.schedule == now.name && c.mode == now.backward && c.recompute_ranks == current.recompute_ranks) {
      out.current_ms = c.step_ms;
    }
  }
  if (out.current_ms == 0) {  // not among the planner's forms (a partition of its own): simulated directly
    out.current_ms = simulate(now, costs.cost_model(current.partition, now.backward, !current.recompute_ranks.empty(),
                                                    options.communication_ms))
                         .step_time;
  }
  std::stable_sort(out.others.begin(), out.others.end(), [](const PlacementCandidate& x, const PlacementCandidate& y) {
    return x.predicted_ms < y.predicted_ms;
  });
  out.fit = costs.how;
  if (out.others.empty()) {
    out.why_none = "no other placement of these ranks and micro-batches fits";
    if (lo.memory_limit_bytes > 0) {
      out.why_none += fmt::format(" within {} per rank (the planner's memory estimate)",
                                  metrics::human_bytes(lo.memory_limit_bytes));
    }
  }
  return out;
}

void switch_form(Pipeline& pipeline, const Placement& to) {
  TWOBP_CHECK(to.schedule.stage_to_rank == pipeline.schedule().stage_to_rank, UsageError,
              "switch_form: {} is another placement than the running {}'s; move there (PlacementSearch::Rebuild)",
              describe(to), pipeline.schedule().name);
  const bool mine = has_rank(to.recompute_ranks, pipeline.rank());
  for (int s : pipeline.stage_indices()) pipeline.stage(s).set_recompute(mine);
  pipeline.switch_schedule(to.schedule);
}

PlacementSearch::PlacementSearch(Pipeline& pipeline, Placement current, double current_ms, Rebuild rebuild,
                                 PlacementSearchOptions options)
    : pipeline_(&pipeline),
      running_(current),
      chosen_{std::move(current), 0.0},
      chosen_ms_(current_ms),
      rebuild_(std::move(rebuild)),
      options_(std::move(options)),
      trial_(pipeline.transport(), options_.replicas, options_.timeout) {
  TWOBP_CHECK(options_.steps >= 2 && options_.candidates >= 1 && options_.within >= 0, UsageError,
              "PlacementSearchOptions: steps must be >= 2 (the first is warm-up), candidates >= 1 and within >= 0; "
              "got {}, {} and {}",
              options_.steps, options_.candidates, options_.within);
  TWOBP_CHECK(static_cast<bool>(rebuild_), UsageError, "PlacementSearch: no Rebuild (the move to another placement)");
}

const char* PlacementSearch::go_to(const Placement& to) {
  const bool same = same_placement(running_, to);
  if (same) {
    switch_form(*pipeline_, to);
  } else {
    pipeline_ = &rebuild_(to);
  }
  running_ = to;
  return same ? "switching to" : "moving to";
}

std::string PlacementSearch::start(const PlacementRanking& ranking) {
  chosen_.predicted_ms = ranking.current_ms;
  const std::string head = fmt::format("auto placement: {} predicted {:.2f} ms/step from costs fitted to the probes "
                                       "({})",
                                       describe(running_), ranking.current_ms, ranking.fit);
  const double best =
      std::min(ranking.current_ms, ranking.others.empty() ? ranking.current_ms : ranking.others.front().predicted_ms);
  for (const PlacementCandidate& c : ranking.others) {
    if (static_cast<int>(trials_.size()) == options_.candidates || c.predicted_ms > best * (1 + options_.within)) {
      break;
    }
    trials_.push_back(c);
  }
  if (trials_.empty()) {
    done_ = true;
    return fmt::format("{}; {}: keeping it", head,
                       ranking.others.empty()
                           ? ranking.why_none
                           : fmt::format("no other placement is predicted faster or within {:.0f} % of it (the "
                                         "fastest, {}, {:.2f})",
                                         100 * options_.within, describe(ranking.others.front().placement),
                                         ranking.others.front().predicted_ms));
  }
  std::vector<std::string> listed;
  for (const PlacementCandidate& c : trials_) {
    listed.push_back(fmt::format("{} ({:.2f})", describe(c.placement), c.predicted_ms));
  }
  go_to(trials_.front().placement);
  trial_.start(options_.steps);
  return fmt::format("{}; measuring the {} of {} forms of other placements predicted fastest: {}; moving to {}", head,
                     trials_.size(), ranking.others.size(), fmt::join(listed, ", "), describe(running_));
}

std::optional<std::string> PlacementSearch::after_step(const StepResult& result) {
  if (done_) return std::nullopt;
  trial_.add(result.pipeline_us / 1000.0);  // the first step of each candidate is warm-up
  if (!trial_.complete()) return std::nullopt;
  const PlacementCandidate& tried = trials_[trial_ms_.size()];
  trial_ms_.push_back(trial_.finish());
  const std::string measured = fmt::format("auto placement: {} {}", describe(tried.placement),
                                           measured_against_prediction(trial_ms_.back(), tried.predicted_ms));
  if (trial_ms_.size() < trials_.size()) {
    const Placement& next = trials_[trial_ms_.size()].placement;
    const char* verb = go_to(next);
    trial_.start(options_.steps);
    return fmt::format("{}; {} {}", measured, verb, describe(next));
  }
  return settle(measured);
}

std::string PlacementSearch::settle(const std::string& measured) {
  // The fastest measured; ties keep the starting form, then the first tried.
  std::vector<double> ms{chosen_ms_};
  ms.insert(ms.end(), trial_ms_.begin(), trial_ms_.end());
  const std::size_t k = fastest(ms);
  const PlacementCandidate& best = k == 0 ? chosen_ : trials_[k - 1];
  done_ = true;
  const bool running = k == trials_.size();
  const char* verb = running ? "keeping" : go_to(best.placement);
  if (k == 0) {
    return fmt::format("{}; back to {}: {:.2f} ms/step, the fastest of {} measured", measured,
                       describe(best.placement), ms[k], ms.size());
  }
  return fmt::format("{}; {} {}: {:.2f} ms/step measured against {:.2f} for {} ({:.2f}x), the fastest of {} "
                     "measured",
                     measured, verb, describe(best.placement), ms[k], chosen_ms_, describe(chosen_.placement),
                     chosen_ms_ / ms[k], ms.size());
}

LlamaAutoTuner::LlamaAutoTuner(Pipeline& pipeline, models::LlamaConfig config, Placement current,
                               LlamaAutoOptions options, PlacementSearch::Rebuild rebuild)
    : config_(std::move(config)),
      running_(std::move(current)),
      built_recompute_(running_.recompute_ranks),
      options_(std::move(options)),
      rebuild_(std::move(rebuild)),
      pipeline_(&pipeline) {
  chooser_.emplace(pipeline, options_.schedule);
}

std::string LlamaAutoTuner::start_search() {
  const MeasuredCosts measured = chooser_->measured_costs();
  const double chosen_ms = chooser_->chosen_ms();
  chooser_.reset();  // it holds the pipeline, which a move replaces
  const AutoScheduleOptions& so = options_.schedule;
  PlacementPlanOptions plan = options_.plan;
  const at::Tensor activation =
      at::zeros({plan.micro_batch_size, plan.seq, config_.dim},
                at::TensorOptions().dtype(compute_dtype(plan.precision)).device(options_.device));
  plan.communication_ms = measure_message_ms(pipeline_->transport(), activation, so.timeout);
  if (so.replicas != nullptr) plan.communication_ms = max_over_ranks(*so.replicas, plan.communication_ms, so.timeout);
  PlacementSearchOptions o;
  o.steps = so.verify_steps;
  o.candidates = so.measure_candidates;
  o.within = so.measure_within;
  o.replicas = so.replicas;
  o.timeout = so.timeout;
  search_.emplace(*pipeline_, running_, chosen_ms, rebuild_, o);
  return search_->start(rank_llama_placements(config_, running_, measured, plan));
}

std::vector<std::string> LlamaAutoTuner::after_step(const StepResult& result) {
  std::vector<std::string> news;
  if (chooser_) {
    if (std::optional<std::string> n = chooser_->after_step(result)) {
      news.push_back(*n);
      ranking_ = chooser_->ranking();
      const std::vector<int>& chosen = chooser_->recompute_ranks();  // empty: as built
      running_.schedule = pipeline_->schedule();
      running_.recompute_ranks = chosen.empty() ? built_recompute_ : chosen;
    }
    if (chooser_->phase() == AutoSchedule::Phase::kDone && options_.placements) news.push_back(start_search());
  } else if (search_ && !search_->done()) {
    if (std::optional<std::string> n = search_->after_step(result)) news.push_back(*n);
  }
  if (search_) running_ = search_->running();
  return news;
}

}  // namespace twobp
