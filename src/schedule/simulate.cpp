// Event-driven simulation of a schedule under a cost model.

#include <algorithm>
#include <map>
#include <utility>

#include "schedule/dry_run.h"
#include "twobp/metrics/metrics.h"
#include "twobp/schedule/schedule.h"
#include "util/check.h"

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
}

}  // namespace

SimulationResult simulate(const Schedule& schedule, const CostModel& costs) {
  detail::check_structure(schedule);
  check_costs(schedule, costs);
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
  for (const SimulatedEvent& e : run.events) {
    result.step_time = std::max(result.step_time, e.end);
    if (is_compute(e.action.type)) {
      busy[e.rank] += e.end - e.start;
      result.events.push_back(e);
    }
  }
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
      } else if (e.action.type == ActionType::kBackwardWeight || e.action.type == ActionType::kBackward) {
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
