#include "schedule/dry_run.h"

#include <algorithm>
#include <utility>
#include <vector>

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

namespace {

// One dry run's state. An item is available on at most two ranks: the owner of its stage (made by a compute
// action) and the rank that receives it (made by a RECV). Slot = (item, stage, mb, received?). Messages are keyed
// by (channel, sending stage, mb). What each action needs and makes comes from dependencies(): the one table of
// action meaning.
class DryRunner {
 public:
  DryRunner(const Schedule& sc, const CostModel& costs)
      : sc_(sc), costs_(costs), S_(sc.num_stages), M_(sc.num_micro_batches), R_(sc.num_ranks) {
    const std::size_t n = static_cast<std::size_t>(S_) * M_;
    item_loc_.resize(kItems * 2 * n);
    send_loc_.resize(2 * n);
    item_time_.assign(kItems * 2 * n, kNotRun);
    send_time_.assign(2 * n, kNotRun);
    clock_.assign(R_, 0.0);
    result_.next.assign(R_, 0);
    result_.event_index.resize(R_);
    for (int r = 0; r < R_; ++r) result_.event_index[r].assign(sc.actions[r].size(), -1);
    find_producers();
  }

  DryRun run(bool force) {
    while (true) {
      run_until_blocked();
      if (!force) break;
      int victim = -1;
      for (int r = 0; r < R_; ++r) {
        if (result_.next[r] < sc_.actions[r].size() && (victim < 0 || clock_[r] < clock_[victim])) victim = r;
      }
      if (victim < 0) break;
      result_.forced.emplace_back(victim, result_.next[victim]);
      result_.next[victim] += try_run(victim, true);
    }
    for (int r = 0; r < R_; ++r) {
      if (result_.next[r] < sc_.actions[r].size()) result_.complete = false;
    }
    if (!result_.forced.empty()) result_.complete = false;
    return std::move(result_);
  }

 private:
  static constexpr std::size_t kItems = 4;

  std::size_t item_slot(const ItemRef& it, int rank) const {
    const bool received = sc_.stage_to_rank[it.stage] != rank;
    return ((static_cast<std::size_t>(it.item) * 2 + (received ? 1 : 0)) * S_ + it.stage) * M_ + it.micro_batch;
  }
  std::size_t message_slot(const Action& a) const {
    const bool send = is_send(a.type);
    const int sender = send ? a.stage : peer_stage(a);
    return (static_cast<std::size_t>(message_channel(a)) * S_ + sender) * M_ + a.micro_batches.front();
  }

  // Producers; the first occurrence wins, duplicates are validate()'s business.
  void find_producers() {
    for (int r = 0; r < R_; ++r) {
      for (std::size_t i = 0; i < sc_.actions[r].size(); ++i) {
        const Action& a = sc_.actions[r][i];
        for (const ItemRef& made : dependencies(a, S_).produces) {
          Loc& l = item_loc_[item_slot(made, r)];
          if (!l.exists()) l = Loc{r, i};
        }
        if (is_send(a.type)) {
          Loc& l = send_loc_[message_slot(a)];
          if (!l.exists()) l = Loc{r, i};
        }
      }
    }
  }

  // When the output of `locs[k]` (finished at times[k]) is usable: kNotRun while it has not run; a producer that is
  // missing altogether counts as available at time 0 (so that broken schedules can still be drawn).
  static double available(const std::vector<Loc>& locs, const std::vector<double>& times, std::size_t k,
                          double latency) {
    if (!locs[k].exists()) return 0.0;
    if (times[k] == kNotRun) return kNotRun;
    return times[k] + latency;
  }

  // When `a` (whose dependencies() are `deps`) could start on rank r: once the rank is free and every input has
  // arrived; kNotRun while one has not (`forced`: as if it had).
  double ready_time(int r, const Action& a, const ActionDependencies& deps, bool forced) const {
    double ready = clock_[r];
    auto need = [&](double t) {
      if (t == kNotRun) return forced;
      ready = std::max(ready, t);
      return true;
    };
    for (const ItemRef& it : deps.needs) {
      std::size_t k = item_slot(it, r);
      double latency = 0.0;
      const int owner = sc_.stage_to_rank[it.stage];
      if (owner != r && !item_loc_[k].exists()) {
        // A schedule without communication actions (compute only, as the simulator accepts it): the item arrives
        // from its owner `communication` after it was made there.
        k = item_slot(it, owner);
        latency = costs_.communication;
      }
      if (!need(available(item_loc_, item_time_, k, latency))) return kNotRun;
    }
    if (is_receive(a.type) && !need(available(send_loc_, send_time_, message_slot(a), costs_.communication))) {
      return kNotRun;
    }
    return ready;
  }

  // Records action `index` of rank r as run from `start` to `end`.
  void record(int r, std::size_t index, const Action& a, const ActionDependencies& deps, double start, double end) {
    clock_[r] = std::max(clock_[r], end);
    const Loc here{r, index};
    auto is_here = [&](const Loc& l) { return l.rank == here.rank && l.index == here.index; };
    for (const ItemRef& made : deps.produces) {
      const std::size_t k = item_slot(made, r);
      if (is_here(item_loc_[k])) item_time_[k] = end;
    }
    if (is_send(a.type)) {
      const std::size_t k = message_slot(a);
      if (is_here(send_loc_[k])) send_time_[k] = end;
    }
    result_.event_index[r][index] = static_cast<long>(result_.events.size());
    result_.events.push_back(SimulatedEvent{r, a, start, end});
  }

  // Runs rank r's next action, or, with CostModel::overlap > 0, the overlapped pair it opens when its partner
  // follows at once (the for_overlapped_pairs layout): both parts from when both can start, over f + x - overlap *
  // min(f, x). Returns how many actions ran (0: the next one cannot run yet).
  std::size_t try_run(int r, bool forced) {
    const auto& list = sc_.actions[r];
    const std::size_t i = result_.next[r];
    const Action& a = list[i];
    const ActionDependencies deps = dependencies(a, S_);
    const double ready = ready_time(r, a, deps, forced);
    if (ready == kNotRun) return 0;
    const bool pair = costs_.overlap > 0.0 && a.overlapped_with_next && i + 1 < list.size() &&
                      is_compute(list[i + 1].type);
    if (!pair) {
      record(r, i, a, deps, ready, ready + action_cost(a, costs_));
      return 1;
    }
    const Action& x = list[i + 1];
    const ActionDependencies deps_x = dependencies(x, S_);
    const double ready_x = ready_time(r, x, deps_x, forced);
    if (ready_x == kNotRun) return 0;
    const double start = std::max(ready, ready_x);
    const double f = action_cost(a, costs_), b = action_cost(x, costs_);
    const double end = start + f + b - costs_.overlap * std::min(f, b);
    record(r, i, a, deps, start, end);
    record(r, i + 1, x, deps_x, start, end);
    return 2;
  }

  // Every rank runs what it can, round after round, until no rank can move.
  void run_until_blocked() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < R_; ++r) {
        while (result_.next[r] < sc_.actions[r].size()) {
          const std::size_t ran = try_run(r, false);
          if (ran == 0) break;
          result_.next[r] += ran;
          progress = true;
        }
      }
    }
  }

  const Schedule& sc_;
  const CostModel& costs_;
  const int S_, M_, R_;
  std::vector<Loc> item_loc_, send_loc_;
  std::vector<double> item_time_, send_time_;
  std::vector<double> clock_;  // per rank: when it is free
  DryRun result_;
};

}  // namespace

DryRun dry_run(const Schedule& sc, const CostModel& costs, bool force) {
  check_plausible_size(sc);
  return DryRunner(sc, costs).run(force);
}

}  // namespace twobp::detail
