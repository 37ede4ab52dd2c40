#pragma once
// Private machinery shared by simulate(), render_grid() and validate(): one evaluation of a schedule in which
// every rank executes its list in order and an action starts once the actions it depends on have executed.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"

namespace twobp::detail {

/// Outcome of a dry run. `events` holds every executed action (communication actions too, with start == end),
/// in execution order. `next[r]` is the index of the first action rank r could not execute; it equals the
/// length of r's list when the rank finished.
struct DryRun {
  std::vector<SimulatedEvent> events;
  std::vector<std::size_t> next;
  /// event_index[r][i]: position in `events` of action i of rank r, or -1 when it never ran.
  std::vector<std::vector<long>> event_index;
  /// Actions run although an input never arrived (only with `force`), as (rank, index).
  std::vector<std::pair<int, std::size_t>> forced;
  bool complete = true;
};

/// Runs `schedule` under `costs`. An action waits until every item it needs (dependencies(): the one table of
/// action meaning) is available on its rank, and a RECV for its matching SEND; data crossing ranks arrives
/// `costs.communication` after the SEND. A dependency whose producer does not occur anywhere in the schedule counts as met at
/// time 0, so that broken schedules can still be drawn; validate() reports those separately.
/// When no rank can move, the run stops (complete = false); with `force` it instead runs the blocked action of the
/// rank that is earliest in time as if its inputs were there, records it in `forced`, and goes on, so that a
/// picture of the whole (broken) schedule can be drawn.
/// With costs.overlap > 0, an overlapped pair (Action::overlapped_with_next) whose second part follows at once runs
/// as one: both parts from when both can start, for the time CostModel::overlap describes.
/// Precondition: stage, rank and micro-batch indices are in range (check_structure() passed).
DryRun dry_run(const Schedule& schedule, const CostModel& costs, bool force = false);

/// Throws ScheduleError when the declared sizes cannot be backed by the actions (see dry_run.cpp), before any
/// stages x micro-batches table is allocated.
void check_plausible_size(const Schedule& schedule);

/// Throws ScheduleError (without a grid) when indices, sizes or the stage placement are inconsistent, i.e. when
/// the schedule cannot even be drawn.
void check_structure(const Schedule& schedule);

}  // namespace twobp::detail
