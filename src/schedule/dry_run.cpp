#include "schedule/dry_run.h"

#include <algorithm>

#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/messages.h"
#include "twobp/schedule/simulate.h"
#include "util/check.h"

namespace twobp::detail {

void check_structure(const Schedule& sc) {
  TWOBP_CHECK(sc.num_ranks >= 1, ScheduleError, "schedule '{}': expected at least 1 rank, found {}", sc.name,
              sc.num_ranks);
  TWOBP_CHECK(sc.num_stages >= 1, ScheduleError, "schedule '{}': expected at least 1 stage, found {}", sc.name,
              sc.num_stages);
  TWOBP_CHECK(sc.num_micro_batches >= 1, ScheduleError, "schedule '{}': expected at least 1 micro-batch, found {}",
              sc.name, sc.num_micro_batches);
  TWOBP_CHECK(static_cast<int>(sc.stage_to_rank.size()) == sc.num_stages, ScheduleError,
              "schedule '{}': expected a placement of {} stages, found {} entries", sc.name, sc.num_stages,
              sc.stage_to_rank.size());
  for (int s = 0; s < sc.num_stages; ++s) {
    TWOBP_CHECK(sc.stage_to_rank[s] >= 0 && sc.stage_to_rank[s] < sc.num_ranks, ScheduleError,
                "schedule '{}': stage {} is placed on rank {}, expected a rank in [0, {})", sc.name, s,
                sc.stage_to_rank[s], sc.num_ranks);
  }
  TWOBP_CHECK(static_cast<int>(sc.actions.size()) == sc.num_ranks, ScheduleError,
              "schedule '{}': expected action lists for {} ranks, found {}", sc.name, sc.num_ranks, sc.actions.size());
  for (int r = 0; r < sc.num_ranks; ++r) {
    for (const Action& a : sc.actions[r]) {
      TWOBP_CHECK(a.stage >= 0 && a.stage < sc.num_stages, ScheduleError,
                  "schedule '{}': rank {}: {}: stage out of range, expected [0, {})", sc.name, r, describe(a),
                  sc.num_stages);
      TWOBP_CHECK(!a.micro_batches.empty(), ScheduleError,
                  "schedule '{}': rank {}: {}: expected at least one micro-batch", sc.name, r, describe(a));
      TWOBP_CHECK(a.type == ActionType::kBackwardWeight || a.micro_batches.size() == 1, ScheduleError,
                  "schedule '{}': rank {}: {}: only W may batch micro-batches, expected exactly one", sc.name, r,
                  describe(a));
      for (int mb : a.micro_batches) {
        TWOBP_CHECK(mb >= 0 && mb < sc.num_micro_batches, ScheduleError,
                    "schedule '{}': rank {}: {}: micro-batch {} out of range, expected [0, {})", sc.name, r,
                    describe(a), mb, sc.num_micro_batches);
      }
      if (!is_compute(a.type)) {
        const int peer = peer_stage(a);
        TWOBP_CHECK(peer >= 0 && peer < sc.num_stages, ScheduleError,
                    "schedule '{}': rank {}: {}: there is no stage {} to communicate with", sc.name, r, describe(a),
                    peer);
      }
    }
  }
}

namespace {

constexpr double kNotRun = -1.0;

struct Loc {
  int rank = -1;
  std::size_t index = 0;
  bool exists() const { return rank >= 0; }
};

}  // namespace

void check_plausible_size(const Schedule& sc) {
  // Tables here and in validate() are sized stages x micro-batches. A complete schedule has at least one action
  // per (stage, micro-batch), so a header claiming more than the actions can cover is rejected before anything
  // that large is allocated (a 100-byte text could otherwise ask for gigabytes).
  std::size_t actions = 0;
  for (const auto& list : sc.actions) actions += list.size();
  const std::size_t needed = static_cast<std::size_t>(std::max(sc.num_stages, 0)) *
                             static_cast<std::size_t>(std::max(sc.num_micro_batches, 0));
  TWOBP_CHECK(needed <= actions && sc.num_ranks <= std::max(sc.num_stages, 1) &&
                  sc.actions.size() == static_cast<std::size_t>(std::max(sc.num_ranks, 0)),
              ScheduleError,
              "schedule '{}' declares {} ranks, {} stages and {} micro-batches but holds {} actions in {} rank lists: "
              "expected at least stages x micro-batches = {} actions, one list per rank and at most one rank per stage",
              sc.name, sc.num_ranks, sc.num_stages, sc.num_micro_batches, actions, sc.actions.size(), needed);
}

DryRun dry_run(const Schedule& sc, const CostModel& costs, bool force) {
  check_plausible_size(sc);
  const int S = sc.num_stages;
  const int M = sc.num_micro_batches;
  const int R = sc.num_ranks;
  const std::size_t n = static_cast<std::size_t>(S) * M;
  constexpr std::size_t kItems = 4;
  // An item is available on at most two ranks: the owner of its stage (made by a compute action) and the rank that
  // receives it (made by a RECV). Slot = (item, stage, mb, received?). Messages are keyed by (channel, sending
  // stage, mb). What each action needs and makes comes from dependencies(): the one table of action meaning.
  auto item_slot = [&](const ItemRef& it, int rank) {
    const bool received = sc.stage_to_rank[it.stage] != rank;
    return ((static_cast<std::size_t>(it.item) * 2 + (received ? 1 : 0)) * S + it.stage) * M + it.micro_batch;
  };
  auto message_slot = [&](const Action& a) {
    const bool send = is_send(a.type);
    const int sender = send ? a.stage : peer_stage(a);
    return (static_cast<std::size_t>(message_channel(a)) * S + sender) * M + a.micro_batches.front();
  };

  // Producers; the first occurrence wins, duplicates are validate()'s business.
  std::vector<Loc> item_loc(kItems * 2 * n), send_loc(2 * n);
  for (int r = 0; r < R; ++r) {
    for (std::size_t i = 0; i < sc.actions[r].size(); ++i) {
      const Action& a = sc.actions[r][i];
      for (const ItemRef& made : dependencies(a, S).produces) {
        Loc& l = item_loc[item_slot(made, r)];
        if (!l.exists()) l = Loc{r, i};
      }
      if (is_send(a.type)) {
        Loc& l = send_loc[message_slot(a)];
        if (!l.exists()) l = Loc{r, i};
      }
    }
  }

  std::vector<double> item_time(kItems * 2 * n, kNotRun), send_time(2 * n, kNotRun);
  std::vector<double> clock(R, 0.0);
  DryRun result;
  result.next.assign(R, 0);
  result.event_index.resize(R);
  for (int r = 0; r < R; ++r) result.event_index[r].assign(sc.actions[r].size(), -1);

  // When the output of `locs[k]` (finished at times[k]) is usable: kNotRun while it has not run; a producer that is
  // missing altogether counts as available at time 0 (so that broken schedules can still be drawn).
  auto available = [](const std::vector<Loc>& locs, const std::vector<double>& times, std::size_t k, double latency) {
    if (!locs[k].exists()) return 0.0;
    if (times[k] == kNotRun) return kNotRun;
    return times[k] + latency;
  };

  // When `a` (whose dependencies() are `deps`) could start on rank r: once the rank is free and every input has
  // arrived; kNotRun while one has not (`forced`: as if it had).
  auto ready_time = [&](int r, const Action& a, const ActionDependencies& deps, bool forced) {
    double ready = clock[r];
    auto need = [&](double t) {
      if (t == kNotRun) return forced;
      ready = std::max(ready, t);
      return true;
    };
    for (const ItemRef& it : deps.needs) {
      std::size_t k = item_slot(it, r);
      double latency = 0.0;
      const int owner = sc.stage_to_rank[it.stage];
      if (owner != r && !item_loc[k].exists()) {
        // A schedule without communication actions (compute only, as the simulator accepts it): the item arrives
        // from its owner `communication` after it was made there.
        k = item_slot(it, owner);
        latency = costs.communication;
      }
      if (!need(available(item_loc, item_time, k, latency))) return kNotRun;
    }
    if (is_receive(a.type) && !need(available(send_loc, send_time, message_slot(a), costs.communication))) {
      return kNotRun;
    }
    return ready;
  };

  // Records action `index` of rank r as run from `start` to `end`.
  auto record = [&](int r, std::size_t index, const Action& a, const ActionDependencies& deps, double start,
                    double end) {
    clock[r] = std::max(clock[r], end);
    const Loc here{r, index};
    auto is_here = [&](const Loc& l) { return l.rank == here.rank && l.index == here.index; };
    for (const ItemRef& made : deps.produces) {
      const std::size_t k = item_slot(made, r);
      if (is_here(item_loc[k])) item_time[k] = end;
    }
    if (is_send(a.type)) {
      const std::size_t k = message_slot(a);
      if (is_here(send_loc[k])) send_time[k] = end;
    }
    result.event_index[r][index] = static_cast<long>(result.events.size());
    result.events.push_back(SimulatedEvent{r, a, start, end});
  };

  // Runs rank r's next action, or, with CostModel::overlap > 0, the overlapped pair it opens when its partner
  // follows at once (the for_overlapped_pairs layout): both parts from when both can start, over f + x - overlap *
  // min(f, x). Returns how many actions ran (0: the next one cannot run yet).
  auto try_run = [&](int r, bool forced) -> std::size_t {
    const auto& list = sc.actions[r];
    const std::size_t i = result.next[r];
    const Action& a = list[i];
    const ActionDependencies deps = dependencies(a, S);
    const double ready = ready_time(r, a, deps, forced);
    if (ready == kNotRun) return 0;
    const bool pair = costs.overlap > 0.0 && a.overlapped_with_next && i + 1 < list.size() &&
                      is_compute(list[i + 1].type);
    if (!pair) {
      record(r, i, a, deps, ready, ready + action_cost(a, costs));
      return 1;
    }
    const Action& x = list[i + 1];
    const ActionDependencies deps_x = dependencies(x, S);
    const double ready_x = ready_time(r, x, deps_x, forced);
    if (ready_x == kNotRun) return 0;
    const double start = std::max(ready, ready_x);
    const double f = action_cost(a, costs), b = action_cost(x, costs);
    const double end = start + f + b - costs.overlap * std::min(f, b);
    record(r, i, a, deps, start, end);
    record(r, i + 1, x, deps_x, start, end);
    return 2;
  };

  while (true) {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < R; ++r) {
        while (result.next[r] < sc.actions[r].size()) {
          const std::size_t ran = try_run(r, false);
          if (ran == 0) break;
          result.next[r] += ran;
          progress = true;
        }
      }
    }
    if (!force) break;
    int victim = -1;
    for (int r = 0; r < R; ++r) {
      if (result.next[r] < sc.actions[r].size() && (victim < 0 || clock[r] < clock[victim])) victim = r;
    }
    if (victim < 0) break;
    result.forced.emplace_back(victim, result.next[victim]);
    result.next[victim] += try_run(victim, true);
  }
  for (int r = 0; r < R; ++r) {
    if (result.next[r] < sc.actions[r].size()) result.complete = false;
  }
  if (!result.forced.empty()) result.complete = false;
  return result;
}

}  // namespace twobp::detail
