// Event-driven simulation of a schedule under a cost model.

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "schedule/dry_run.h"
#include "twobp/metrics/metrics.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "util/check.h"
#include "util/cost_check.h"

namespace twobp {
namespace {

void check_costs(const Schedule& sc, const CostModel& costs) {
  auto check_size = [&](const std::vector<double>& v, const char* what) {
    TWOBP_CHECK(static_cast<int>(v.size()) == sc.num_stages, UsageError,
                "simulate: CostModel.{} has {} entries, expected one per stage ({})", what, v.size(), sc.num_stages);
  };
  bool has_f = false, has_i = false, has_w = false, has_b = false;
  for (const auto& list : sc.actions) {
    for (const Action& a : list) {
      has_f |= a.type == ActionType::kForward;
      has_i |= a.type == ActionType::kBackwardInput;
      has_w |= a.type == ActionType::kBackwardWeight;
      has_b |= a.type == ActionType::kBackward;
    }
  }
  if (has_f) check_size(costs.forward, "forward");
  if (has_i || (has_b && costs.backward.empty())) check_size(costs.backward_input, "backward_input");
  if (has_w || (has_b && costs.backward.empty())) check_size(costs.backward_weight, "backward_weight");
  if (has_b && !costs.backward.empty()) check_size(costs.backward, "backward");
  if (!costs.backward_weight_fixed.empty()) check_size(costs.backward_weight_fixed, "backward_weight_fixed");
  if (!costs.recompute.empty()) check_size(costs.recompute, "recompute");
  detail::check_cost_model(costs, "simulate");
  TWOBP_CHECK(costs.overlap >= 0.0 && costs.overlap <= 1.0, UsageError,
              "simulate: CostModel.overlap is {}, expected a share in [0, 1] (0: overlapped pairs run in order)",
              costs.overlap);
  if (!costs.data_parallel_reduce.empty()) {
    check_size(costs.data_parallel_reduce, "data_parallel_reduce");
    TWOBP_CHECK(costs.data_parallel_buckets >= 1, UsageError,
                "simulate: CostModel.data_parallel_buckets is {}, expected >= 1", costs.data_parallel_buckets);
  }
}

/// The last weight-producing action of a stage: when it started and ended, and whether it was a W.
struct LastWeightAction {
  double start = -1.0, end = -1.0;  // end < 0: the schedule has none
  bool is_w = false;
};

/// Ends of each rank's data-parallel reductions (simulate() in twobp/schedule/simulate.h): per rank, the end of its
/// last all-reduce, or `compute_end[r]` when it has none.
std::vector<double> reduction_ends(const Schedule& sc, const CostModel& costs, const std::vector<double>& compute_end,
                                   const std::vector<LastWeightAction>& last_weight) {
  const int k = costs.data_parallel_buckets;
  std::vector<double> ends = compute_end;
  for (int r = 0; r < sc.num_ranks; ++r) {
    // (ready time, stage), one per bucket, served in this order on the rank's one link.
    std::vector<std::pair<double, int>> ready;
    for (int s : sc.stages_of(r)) {
      const LastWeightAction& w = last_weight[s];
      const bool overlap = costs.overlap_data_parallel && w.end >= 0.0;
      for (int j = 0; j < k; ++j) {
        const double t = !overlap ? compute_end[r]
                         : w.is_w ? w.start + (w.end - w.start) * (j + 1) / static_cast<double>(k)
                                  : w.end;
        ready.emplace_back(t, s);
      }
    }
    std::stable_sort(ready.begin(), ready.end());
    double link_free = 0.0;
    for (const auto& [t, s] : ready) link_free = std::max(link_free, t) + costs.data_parallel_reduce[s] / k;
    ends[r] = std::max(compute_end[r], link_free);
  }
  return ends;
}

}  // namespace

double CostModel::weight(int stage, int micro_batches) const {
  const auto s = static_cast<std::size_t>(stage);
  const double fixed = backward_weight_fixed.empty() ? 0.0 : backward_weight_fixed.at(s);
  return fixed + backward_weight.at(s) * static_cast<double>(micro_batches);
}

double CostModel::unfused_backward(int stage) const {
  return backward_input.at(static_cast<std::size_t>(stage)) + weight(stage, 1);
}

CostModel CostModel::uniform(int num_stages, double f, double i, double w, double comm) {
  CostModel costs;
  costs.forward.assign(num_stages, f);
  costs.backward_input.assign(num_stages, i);
  costs.backward_weight.assign(num_stages, w);
  costs.communication = comm;
  return costs;
}

double action_cost(const Action& action, const CostModel& costs) {
  const auto s = static_cast<std::size_t>(action.stage);
  // Activation recomputation re-runs the forward at the start of the micro-batch's I or B.
  const double recompute = costs.recompute.empty() ? 0.0 : costs.recompute.at(s);
  // CostModel::per_action: once per compute action, whatever its micro-batches (the one place it is charged).
  const double fixed = costs.per_action;
  switch (action.type) {
    case ActionType::kForward:
      return fixed + costs.forward.at(s);
    case ActionType::kBackwardInput:
      return fixed + recompute + costs.backward_input.at(s);
    case ActionType::kBackwardWeight:
      return fixed + costs.weight(action.stage, static_cast<int>(action.micro_batches.size()));
    case ActionType::kBackward:
      return fixed + recompute +
             (costs.backward.empty() ? costs.unfused_backward(action.stage) : costs.backward.at(s));
    default:
      return 0.0;
  }
}

CostModel RankCosts::per_stage(int num_stages, int ranks) const {
  TWOBP_CHECK(ranks >= 1 && num_stages >= ranks && num_stages % ranks == 0, UsageError,
              "RankCosts: {} stages do not split into {} ranks' chunks", num_stages, ranks);
  const double v = static_cast<double>(num_stages) / ranks;
  CostModel c = CostModel::uniform(num_stages, forward / v, backward_input / v, backward_weight / v, communication);
  c.backward.assign(num_stages, backward / v);
  if (backward_weight_fixed > 0.0) c.backward_weight_fixed.assign(num_stages, backward_weight_fixed / v);
  return c;
}

SimulationResult simulate(const Schedule& given, const CostModel& costs) {
  detail::check_structure(given);
  check_costs(given, costs);
  // Pairs run at once only in the layout a runtime that overlaps them runs (their B's receives before the F).
  const Schedule laid_out = costs.overlap > 0.0 ? for_overlapped_pairs(given) : Schedule{};
  const Schedule& schedule = costs.overlap > 0.0 ? laid_out : given;
  detail::DryRun run = detail::dry_run(schedule, costs);
  if (!run.complete) {
    for (int r = 0; r < schedule.num_ranks; ++r) {
      if (run.next[r] < schedule.actions[r].size()) {
        const Action& blocked = schedule.actions[r][run.next[r]];
        detail::raise<ScheduleError>("simulate: schedule '{}' deadlocks: rank {} waits forever at {}\n{}",
                                     schedule.name, r, describe(blocked), render_grid(schedule, &blocked, r));
      }
    }
  }

  SimulationResult result;
  std::vector<double> busy(schedule.num_ranks, 0.0);
  std::vector<double> compute_end(schedule.num_ranks, 0.0);   // end of the rank's last action
  std::vector<LastWeightAction> last_weight(schedule.num_stages);
  for (const SimulatedEvent& e : run.events) {
    if (is_compute(e.action.type)) {
      // A rank's events come in its order; the second part of a pair run at once covers no new time.
      busy[e.rank] += std::max(0.0, e.end - std::max(e.start, compute_end[e.rank]));
      result.events.push_back(e);
    }
    compute_end[e.rank] = std::max(compute_end[e.rank], e.end);
    if (makes_weight_grads(e.action.type) && e.end > last_weight[e.action.stage].end) {
      last_weight[e.action.stage] = {e.start, e.end, e.action.type == ActionType::kBackwardWeight};
    }
  }
  const std::vector<double> rank_end = costs.data_parallel_reduce.empty()
                                           ? compute_end
                                           : reduction_ends(schedule, costs, compute_end, last_weight);
  result.data_parallel_exposed_per_rank.assign(schedule.num_ranks, 0.0);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    result.step_time = std::max(result.step_time, rank_end[r]);
    result.data_parallel_exposed_per_rank[r] = rank_end[r] - compute_end[r];
    result.data_parallel_exposed = std::max(result.data_parallel_exposed, result.data_parallel_exposed_per_rank[r]);
  }
  TWOBP_CHECK(std::isfinite(result.step_time), UsageError,
              "simulate: schedule '{}' takes {} under these costs: each cost is finite, but they add up past the "
              "largest double (a cost near 1e308?)",
              schedule.name, result.step_time);
  result.bubble_fraction = metrics::bubble_fraction(busy, result.step_time);
  std::stable_sort(result.events.begin(), result.events.end(), [](const SimulatedEvent& a, const SimulatedEvent& b) {
    return a.start != b.start ? a.start < b.start : a.rank < b.rank;
  });

  // A micro-batch's activations on a stage live from the start of its F to the end of the last backward action
  // that reads them (B, or the W covering it).
  std::vector<std::map<std::pair<int, int>, std::pair<double, double>>> live(schedule.num_ranks);
  for (const SimulatedEvent& e : result.events) {
    auto& spans = live[e.rank];
    for (int mb : e.action.micro_batches) {
      auto [it, inserted] = spans.try_emplace({e.action.stage, mb}, e.start, e.end);
      if (e.action.type == ActionType::kForward) {
        it->second.first = e.start;
      } else if (makes_weight_grads(e.action.type)) {
        it->second.second = std::max(it->second.second, e.end);
      } else if (inserted) {
        it->second.second = e.end;
      } else {
        it->second.second = std::max(it->second.second, e.end);
      }
    }
  }
  result.peak_live_micro_batches.assign(schedule.num_ranks, 0);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    // Sweep; at equal times an end is processed before a start, because a micro-batch whose last backward ended
    // at t no longer holds memory when another's F starts at t.
    std::vector<std::pair<double, int>> points;
    for (const auto& [k, span] : live[r]) {
      points.emplace_back(span.first, +1);
      points.emplace_back(span.second, -1);
    }
    std::sort(points.begin(), points.end());
    int current = 0, peak = 0;
    for (const auto& [t, delta] : points) {
      current += delta;
      peak = std::max(peak, current);
    }
    result.peak_live_micro_batches[r] = peak;
  }
  return result;
}

}  // namespace twobp
