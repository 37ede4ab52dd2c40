// Built-in schedule generators: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-v, looped-bfs, interleaved-zb,
// dualpipev, v-half, v-min (and the registry entry of synth, synthesize.cpp).

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <deque>
#include <functional>
#include <map>
#include <utility>

#include "schedule/generators.h"
#include "schedule/weight_runs.h"
#include "twobp/schedule/registry.h"
#include "util/check.h"

namespace twobp {
namespace {

struct Task {
  ActionType type;
  int stage;
  int mb;
};

using RankTasks = std::vector<std::vector<Task>>;

Schedule empty_schedule(std::string name, int ranks, std::vector<int> placement, int micro_batches, BackwardMode mode) {
  Schedule sc;
  sc.name = std::move(name);
  sc.num_ranks = ranks;
  sc.num_stages = static_cast<int>(placement.size());
  sc.num_micro_batches = micro_batches;
  sc.backward = mode;
  sc.stage_to_rank = std::move(placement);
  sc.actions.assign(ranks, {});
  return sc;
}

void check_basic(std::string_view name, const ScheduleOptions& o) {
  TWOBP_CHECK(o.ranks >= 1, ScheduleError, "{}: expected at least 1 rank, got ranks={}", name, o.ranks);
  TWOBP_CHECK(o.micro_batches >= 1, ScheduleError, "{}: expected at least 1 micro-batch, got micro_batches={}", name,
              o.micro_batches);
}

void check_one_chunk(std::string_view name, const ScheduleOptions& o) {
  TWOBP_CHECK(o.chunks_per_rank == 1, ScheduleError,
              "{} places one stage per rank: expected chunks_per_rank=1, got {} (use interleaved-1f1b or zb-v for "
              "several chunks per rank)",
              name, o.chunks_per_rank);
}

Action to_action(const Task& t) { return Action{t.type, t.stage, {t.mb}}; }

// Tracks, in whole time units, when each F and I finished; the generators below use it to decide where a W can
// fill a gap. Costs are F = I = W = 1 and no communication latency, the setting the papers draw their schedules in.
class UnitClock {
 public:
  UnitClock(int num_stages, int micro_batches)
      : S_(num_stages),
        M_(micro_batches),
        f_end_(static_cast<std::size_t>(num_stages) * micro_batches, -1),
        i_end_(f_end_.size(), -1) {}

  bool f_ready(int s, int mb, long t) const { return s == 0 || done(f_end_, s - 1, mb, t); }
  bool i_ready(int s, int mb, long t) const {
    return done(f_end_, s, mb, t) && (s + 1 == S_ || done(i_end_, s + 1, mb, t));
  }
  bool ready(const Task& task, long t) const {
    return task.type == ActionType::kForward ? f_ready(task.stage, task.mb, t) : i_ready(task.stage, task.mb, t);
  }
  void finish(const Task& task, long end) {
    (task.type == ActionType::kForward ? f_end_ : i_end_)[key(task.stage, task.mb)] = end;
  }

 private:
  std::size_t key(int s, int mb) const { return static_cast<std::size_t>(s) * M_ + mb; }
  bool done(const std::vector<long>& ends, int s, int mb, long t) const {
    const long e = ends[key(s, mb)];
    return e >= 0 && e <= t;
  }
  int S_;
  int M_;
  std::vector<long> f_end_;
  std::vector<long> i_end_;
};

// Guards the unit-time loops: a correct order finishes long before this many steps.
long step_limit(const RankTasks& tasks) {
  long total = 0;
  for (const auto& list : tasks) total += static_cast<long>(list.size());
  return 4 * total + 16;
}

// Appends the W's still pending as one batched W per stage (oldest stage first): 2BP's end-of-step W, whose
// GEMMs over several micro-batches run at higher utilisation than one W per micro-batch.
void append_batched_weights(std::vector<Action>& out, const std::deque<std::pair<int, int>>& pending) {
  std::vector<int> order;
  std::map<int, std::vector<int>> by_stage;
  for (const auto& [stage, mb] : pending) {
    if (!by_stage.count(stage)) order.push_back(stage);
    by_stage[stage].push_back(mb);
  }
  for (int stage : order) out.push_back(Action{ActionType::kBackwardWeight, stage, by_stage[stage]});
}

// 2BP's W placement for gpipe/1f1b/interleaved: `main` holds each rank's F/I order. Once a rank has issued its
// last F (cool-down), a W of the oldest pending micro-batch runs wherever the rank's next I is not ready yet under
// unit costs, i.e. where the rank would otherwise idle; whatever is pending when the I's run out becomes one
// batched W per stage at the end of the step.
std::vector<std::vector<Action>> fill_weights_in_cooldown(const RankTasks& main, int num_stages, int micro_batches) {
  const int R = static_cast<int>(main.size());
  UnitClock clock(num_stages, micro_batches);
  std::vector<std::size_t> pos(R, 0);
  std::vector<long> busy_until(R, 0);
  std::vector<int> forwards_left(R, 0);
  std::vector<std::deque<std::pair<int, int>>> pending(R);
  std::vector<std::vector<Action>> out(R);
  for (int r = 0; r < R; ++r) {
    for (const Task& t : main[r]) forwards_left[r] += t.type == ActionType::kForward ? 1 : 0;
  }
  const long limit = step_limit(main);
  for (long t = 0;; ++t) {
    bool all_done = true;
    for (int r = 0; r < R; ++r) all_done = all_done && pos[r] == main[r].size();
    if (all_done) break;
    TWOBP_CHECK(t <= limit, ScheduleError, "internal error: the generated F/I order cannot complete");
    for (int r = 0; r < R; ++r) {
      if (busy_until[r] > t || pos[r] == main[r].size()) continue;
      const Task& next = main[r][pos[r]];
      if (clock.ready(next, t)) {
        clock.finish(next, t + 1);
        out[r].push_back(to_action(next));
        if (next.type == ActionType::kForward) --forwards_left[r];
        if (next.type == ActionType::kBackwardInput) pending[r].emplace_back(next.stage, next.mb);
        ++pos[r];
        busy_until[r] = t + 1;
      } else if (forwards_left[r] == 0 && !pending[r].empty()) {
        const auto [stage, mb] = pending[r].front();
        pending[r].pop_front();
        out[r].push_back(Action{ActionType::kBackwardWeight, stage, {mb}});
        busy_until[r] = t + 1;
      }
    }
  }
  for (int r = 0; r < R; ++r) append_batched_weights(out[r], pending[r]);
  return out;
}

// Turns a compute order into the schedule of the requested mode. `split_order` is the order with I's (and, for the
// zero-bubble schedules, W's); the standard form drops each W and turns its I into B.
Schedule finish(Schedule sc, std::vector<std::vector<Action>> split_order) {
  if (sc.backward == BackwardMode::kStandard) {
    for (auto& list : split_order) {
      std::vector<Action> fused;
      for (Action& a : list) {
        if (a.type == ActionType::kBackwardWeight) continue;
        if (a.type == ActionType::kBackwardInput) a.type = ActionType::kBackward;
        fused.push_back(std::move(a));
      }
      list = std::move(fused);
    }
  }
  sc.actions = std::move(split_order);
  return add_communication(std::move(sc));
}

// Completes a 1F1B-style F/backward order: as is in standard mode, with 2BP's W placement in split mode.
Schedule from_main_order(Schedule sc, const RankTasks& main) {
  if (sc.backward == BackwardMode::kStandard) {
    std::vector<std::vector<Action>> order(main.size());
    for (std::size_t r = 0; r < main.size(); ++r) {
      for (const Task& t : main[r]) order[r].push_back(to_action(t));
    }
    return finish(std::move(sc), std::move(order));
  }
  auto order = fill_weights_in_cooldown(main, sc.num_stages, sc.num_micro_batches);
  return finish(std::move(sc), std::move(order));
}

std::vector<int> linear_placement(int ranks) {
  std::vector<int> p(ranks);
  for (int s = 0; s < ranks; ++s) p[s] = s;
  return p;
}

// ---- gpipe -------------------------------------------------------------------------------------------------------

Schedule gpipe(const ScheduleOptions& o) {
  check_basic("gpipe", o);
  check_one_chunk("gpipe", o);
  const int p = o.ranks, m = o.micro_batches;
  Schedule sc = empty_schedule("gpipe", p, linear_placement(p), m, o.backward);
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    for (int mb = 0; mb < m; ++mb) order[r].push_back(Action{ActionType::kForward, r, {mb}});
    // Increasing order on the backward too: the transport matches the messages of a link in order.
    for (int mb = 0; mb < m; ++mb) order[r].push_back(Action{ActionType::kBackwardInput, r, {mb}});
    std::vector<int> all(m);
    for (int mb = 0; mb < m; ++mb) all[mb] = mb;
    order[r].push_back(Action{ActionType::kBackwardWeight, r, all});
  }
  return finish(std::move(sc), std::move(order));
}

// ---- 1f1b --------------------------------------------------------------------------------------------------------

// Megatron-LM's non-interleaved 1F1B order of F and backward: p-1-r warm-up forwards (fewer when m is small),
// then one F and one backward in turn, then the remaining backwards.
RankTasks one_f_one_b_order(int p, int m, ActionType bwd) {
  RankTasks main(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - 1 - r, m);
    for (int mb = 0; mb < warmup; ++mb) main[r].push_back({ActionType::kForward, r, mb});
    for (int k = 0; k < m - warmup; ++k) {
      main[r].push_back({ActionType::kForward, r, warmup + k});
      main[r].push_back({bwd, r, k});
    }
    for (int mb = m - warmup; mb < m; ++mb) main[r].push_back({bwd, r, mb});
  }
  return main;
}

Schedule one_f_one_b(const ScheduleOptions& o) {
  check_basic("1f1b", o);
  check_one_chunk("1f1b", o);
  const int p = o.ranks, m = o.micro_batches;
  Schedule sc = empty_schedule("1f1b", p, linear_placement(p), m, o.backward);
  const ActionType bwd = o.backward == BackwardMode::kSplit ? ActionType::kBackwardInput : ActionType::kBackward;
  return from_main_order(std::move(sc), one_f_one_b_order(p, m, bwd));
}

// ---- interleaved-1f1b (Megatron-LM's virtual pipeline) -----------------------------------------------------------

// The order of virtual micro-batches: groups of micro-batches, each group through chunk 0, then chunk 1, ...
// (Megatron-LM's get_schedule_table). Entry k: (micro-batch, chunk) of the k-th forward; the k-th backward takes
// the same micro-batch through the chunks in reverse.
std::vector<std::pair<int, int>> interleaved_table(const std::vector<int>& groups, int v) {
  std::vector<std::pair<int, int>> table;
  int first = 0;
  for (int g : groups) {
    for (int chunk = 0; chunk < v; ++chunk) {
      for (int mb = first; mb < first + g; ++mb) table.emplace_back(mb, chunk);
    }
    first += g;
  }
  return table;
}

// The micro-batch groups of the interleaved schedules: rounds = max(1, m / p) groups (PyTorch's rounds), as equal
// as m allows -- the first m % rounds one larger -- so every group holds at least p micro-batches, or all m < p.
// Where rounds divides m this is PyTorch's (and, for m % p == 0, Megatron-LM's) grouping exactly; other m PyTorch
// refuses. Sizes in order.
std::vector<int> interleaved_groups(std::string_view name, const ScheduleOptions& o) {
  const int p = o.ranks, m = o.micro_batches, v = o.chunks_per_rank;
  TWOBP_CHECK(v >= 1, ScheduleError, "{}: expected chunks_per_rank >= 1, got {}", name, v);
  const int rounds = std::max(1, m / p);
  std::vector<int> groups(rounds, m / rounds);
  for (int k = 0; k < m % rounds; ++k) ++groups[k];
  return groups;
}

std::vector<int> looped_placement(int p, int v) {
  std::vector<int> placement(static_cast<std::size_t>(p) * v);
  for (int s = 0; s < p * v; ++s) placement[s] = s % p;
  return placement;
}

// Megatron-LM's interleaved 1F1B in groups (interleaved_groups; PyTorch's ScheduleInterleaved1F1B): the warm-up
// is 2 (p - 1 - rank) + (v - 1) g forwards, g the first (largest) group.
Schedule interleaved(const ScheduleOptions& o) {
  check_basic("interleaved-1f1b", o);
  const std::vector<int> groups = interleaved_groups("interleaved-1f1b", o);
  const int p = o.ranks, m = o.micro_batches, v = o.chunks_per_rank, g = groups.front();
  Schedule sc = empty_schedule("interleaved-1f1b", p, looped_placement(p, v), m, o.backward);
  const ActionType bwd = o.backward == BackwardMode::kSplit ? ActionType::kBackwardInput : ActionType::kBackward;
  const int total = m * v;
  const auto table = interleaved_table(groups, v);
  RankTasks main(p);
  for (int r = 0; r < p; ++r) {
    auto forward = [&](int k) { return Task{ActionType::kForward, table[k].second * p + r, table[k].first}; };
    auto backward = [&](int k) { return Task{bwd, (v - 1 - table[k].second) * p + r, table[k].first}; };
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * g, total);
    for (int k = 0; k < warmup; ++k) main[r].push_back(forward(k));
    for (int k = 0; k < total - warmup; ++k) {
      main[r].push_back(forward(warmup + k));
      main[r].push_back(backward(k));
    }
    for (int k = total - warmup; k < total; ++k) main[r].push_back(backward(k));
  }
  return from_main_order(std::move(sc), main);
}

// ---- interleaved-zb (PyTorch's ScheduleInterleavedZeroBubble: the zero-bubble paper's ZB1P over v chunks) ----------

// The interleaved order of F's and I's in groups (interleaved_groups; g the first), with a warm-up of only
// (p - 1 - rank) + (v - 1) g forwards (one per hop from the last rank instead of 1F1B's two: the W's fill the
// slots that second forward filled), and ZB-H1's W placement: rank r runs the W of its k-th backward right after
// its (k + r)-th I, the last r + 1 W's close the step. Any v >= 1 (zb-v is the V-shaped v = 2 variant); the split
// form is PyTorch's action for action.
Schedule interleaved_zb(const ScheduleOptions& o) {
  check_basic("interleaved-zb", o);
  const std::vector<int> groups = interleaved_groups("interleaved-zb", o);
  const int p = o.ranks, m = o.micro_batches, v = o.chunks_per_rank, g = groups.front();
  Schedule sc = empty_schedule("interleaved-zb", p, looped_placement(p, v), m, o.backward);
  const int total = m * v;
  const auto table = interleaved_table(groups, v);
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    auto& out = order[r];
    auto forward = [&](int k) {
      out.push_back(Action{ActionType::kForward, table[k].second * p + r, {table[k].first}});
    };
    auto backward_stage = [&](int k) { return (v - 1 - table[k].second) * p + r; };
    int weights = 0;
    auto backward = [&](int k) {
      out.push_back(Action{ActionType::kBackwardInput, backward_stage(k), {table[k].first}});
      if (k >= r) {
        out.push_back(Action{ActionType::kBackwardWeight, backward_stage(weights), {table[weights].first}});
        ++weights;
      }
    };
    const int warmup = std::min((p - r - 1) + (v - 1) * g, total);
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int k = 0; k < total - warmup; ++k) {
      forward(warmup + k);
      backward(k);
    }
    for (int k = total - warmup; k < total; ++k) backward(k);
    for (; weights < total; ++weights) {
      out.push_back(Action{ActionType::kBackwardWeight, backward_stage(weights), {table[weights].first}});
    }
  }
  return finish(std::move(sc), std::move(order));
}

// ---- looped-bfs (PyTorch's ScheduleLoopedBFS) ----------------------------------------------------------------------

// Breadth first over v looped chunks (stage s on rank s % p): each rank runs its chunks' forwards in chunk order,
// every micro-batch of a chunk before the next chunk, then their backwards in reverse chunk order, each chunk's
// micro-batches from the last one (PyTorch's order, so the two write the same CSV). 2BP: I's where the B's were,
// then one batched W per stage in the order its I's ended.
Schedule looped_bfs(const ScheduleOptions& o) {
  check_basic("looped-bfs", o);
  const int p = o.ranks, m = o.micro_batches, v = o.chunks_per_rank;
  TWOBP_CHECK(v >= 1, ScheduleError, "looped-bfs: expected chunks_per_rank >= 1, got {}", v);
  Schedule sc = empty_schedule("looped-bfs", p, looped_placement(p, v), m, o.backward);
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    for (int chunk = 0; chunk < v; ++chunk) {
      for (int mb = 0; mb < m; ++mb) order[r].push_back(Action{ActionType::kForward, chunk * p + r, {mb}});
    }
    std::deque<std::pair<int, int>> pending;
    for (int chunk = v - 1; chunk >= 0; --chunk) {
      for (int mb = m - 1; mb >= 0; --mb) {
        order[r].push_back(Action{ActionType::kBackwardInput, chunk * p + r, {mb}});
        pending.emplace_back(chunk * p + r, mb);
      }
    }
    append_batched_weights(order[r], pending);
  }
  return finish(std::move(sc), std::move(order));
}

// ---- zb-h1 / zb-h2 -----------------------------------------------------------------------------------------------

// ZB-H1 (Qi et al., section 3.1): 1F1B's order of F and I, with the W's moved later: rank r runs W of micro-batch
// j right after I of micro-batch j + r, and the last r + 1 W's close the step. Every rank then holds at most p
// micro-batches, 1F1B's peak (rank 0's), and under F = I = W the step takes 3m + p - 1, i.e. a bubble of
// (p-1)(F + I - W) per rank instead of 1F1B's (p-1)(F + I + W).
Schedule zb_h1(const ScheduleOptions& o) {
  check_basic("zb-h1", o);
  check_one_chunk("zb-h1", o);
  const int p = o.ranks, m = o.micro_batches;
  Schedule sc = empty_schedule("zb-h1", p, linear_placement(p), m, o.backward);
  const RankTasks main = one_f_one_b_order(p, m, ActionType::kBackwardInput);
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    int next_w = 0;
    for (const Task& t : main[r]) {
      order[r].push_back(to_action(t));
      if (t.type == ActionType::kBackwardInput && t.mb - r >= 0) {
        order[r].push_back(Action{ActionType::kBackwardWeight, r, {next_w++}});
      }
    }
    while (next_w < m) order[r].push_back(Action{ActionType::kBackwardWeight, r, {next_w++}});
  }
  return finish(std::move(sc), std::move(order));
}

// ZB-H2 (Qi et al., section 3.1) on one stage per rank, laid out as the paper's greedy does under F = I = W: each
// rank runs an I as soon as its gradient is there, else an F if fewer than 2p - 1 micro-batches hold activations (F
// issued, W not yet), else the oldest pending W. The longer warm-up fills the bubble before the first I, and the
// I-first rule pulls the tail's I's forward and leaves its W's last (the paper's trapezoid-to-parallelogram
// reordering); under F = I = W the step takes 3m + p - 1, the minimum for one step.
Schedule zb_h2(const ScheduleOptions& o) {
  const char* name = "zb-h2";
  const int limit = 2 * o.ranks - 1;
  check_basic(name, o);
  check_one_chunk(name, o);
  const int p = o.ranks, m = o.micro_batches;
  Schedule sc = empty_schedule(name, p, linear_placement(p), m, o.backward);
  UnitClock clock(p, m);
  std::vector<int> next_f(p, 0), next_i(p, 0), in_flight(p, 0);
  std::vector<long> busy_until(p, 0);
  std::vector<std::deque<int>> pending(p);
  std::vector<std::vector<Action>> order(p);
  const long steps = 16L * p * m + 16;
  for (long t = 0;; ++t) {
    bool all_done = true;
    for (int r = 0; r < p; ++r) all_done = all_done && next_i[r] == m && pending[r].empty();
    if (all_done) break;
    TWOBP_CHECK(t <= steps, ScheduleError, "internal error: {} cannot complete for p={} m={}", name, p, m);
    for (int r = 0; r < p; ++r) {
      if (busy_until[r] > t) continue;
      const int s = r;
      if (next_i[r] < m && clock.i_ready(s, next_i[r], t)) {
        const Task task{ActionType::kBackwardInput, s, next_i[r]++};
        clock.finish(task, t + 1);
        order[r].push_back(to_action(task));
        pending[r].push_back(task.mb);
      } else if (next_f[r] < m && in_flight[r] < limit && clock.f_ready(s, next_f[r], t)) {
        const Task task{ActionType::kForward, s, next_f[r]++};
        clock.finish(task, t + 1);
        order[r].push_back(to_action(task));
        ++in_flight[r];
      } else if (!pending[r].empty()) {
        order[r].push_back(Action{ActionType::kBackwardWeight, s, {pending[r].front()}});
        pending[r].pop_front();
        --in_flight[r];
      } else {
        continue;
      }
      busy_until[r] = t + 1;
    }
  }
  return finish(std::move(sc), std::move(order));
}

// ---- V placement (zb-v, dualpipev, v-half, v-min) -----------------------------------------------------------------

// Two chunks per rank in a V: stage s on rank s for s < p, on rank 2p-1-s otherwise (rank r holds r and 2p-1-r).
std::vector<int> v_placement(std::string_view name, const ScheduleOptions& o) {
  TWOBP_CHECK(o.chunks_per_rank == 1 || o.chunks_per_rank == 2, ScheduleError,
              "{} always places 2 stages per rank: expected chunks_per_rank=2, got {}", name, o.chunks_per_rank);
  const int p = o.ranks;
  std::vector<int> placement(2 * static_cast<std::size_t>(p));
  for (int s = 0; s < 2 * p; ++s) placement[s] = s < p ? s : 2 * p - 1 - s;
  return placement;
}

// ---- zb-v --------------------------------------------------------------------------------------------------------

// ZB-V (Qi et al., section 6): two chunks per rank in a V, rank r holding stages r and 2p-1-r. The order is the
// handcrafted one for F = I = W, written for n = max(2p - 1, m) micro-batches; for smaller m the actions of the
// missing micro-batches are dropped, which only removes dependencies and so keeps the order deadlock-free.
Schedule zb_v(const ScheduleOptions& o) {
  check_basic("zb-v", o);
  const int p = o.ranks, m = o.micro_batches;
  const int S = 2 * p;
  Schedule sc = empty_schedule("zb-v", p, v_placement("zb-v", o), m, o.backward);
  const int n = std::max(2 * p - 1, m);
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    const int s0 = r, s1 = S - 1 - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto& out = order[r];
    auto add = [&](ActionType type, int stage, int mb) {
      if (mb < m) out.push_back(Action{type, stage, {mb}});
    };
    for (int k = 0; k < 2 * (p - r) - 1; ++k) add(ActionType::kForward, s0, f0++);
    for (int k = 0; k < r; ++k) {
      add(ActionType::kForward, s1, f1++);
      add(ActionType::kForward, s0, f0++);
    }
    for (int k = 0; k < p - r; ++k) {
      add(ActionType::kForward, s1, f1++);
      add(ActionType::kBackwardInput, s1, b1);
      add(ActionType::kBackwardWeight, s1, b1++);
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) add(ActionType::kForward, s0, f0++);
      add(ActionType::kBackwardInput, s0, b0);
      add(ActionType::kBackwardWeight, s0, b0++);
      add(ActionType::kForward, s1, f1++);
      add(ActionType::kBackwardInput, s1, b1);
      add(ActionType::kBackwardWeight, s1, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int k = 0; k < r; ++k) {
      add(ActionType::kBackwardInput, s0, b0++);
      add(ActionType::kBackwardInput, s1, b1++);
    }
    for (int k = 0; k < p - r; ++k) {
      add(ActionType::kBackwardInput, s0, b0++);
      add(ActionType::kBackwardWeight, s0, w0++);
    }
    while (w1 < b1) add(ActionType::kBackwardWeight, s1, w1++);
    while (w0 < b0) add(ActionType::kBackwardWeight, s0, w0++);
  }
  return finish(std::move(sc), std::move(order));
}

// ---- dualpipev (DeepSeek's DualPipeV; PyTorch's ScheduleDualPipeV) -------------------------------------------------

// DualPipe "cut in half" (DeepSeek-V3, arXiv 2412.19437; the order of deepseek-ai/DualPipe's dualpipev.py, which
// PyTorch's ScheduleDualPipeV reproduces): V placement, rank r holding stages r (chunk 0) and 2p-1-r (chunk 1). After
// a warm-up, the steady state pairs one micro-batch's F with another's fused B (F0 B1, then F1 B0: the pairs DualPipe
// overlaps so that one's communication hides under the other's compute; here overlapped pairs,
// Action::overlapped_with_next, which the Executor runs in order unless a hook overlaps them); the I/W split is used
// only where a bubble would be -- at the V's turn (I1 W1 F1) and in the tail, where the deferred W's (oldest first)
// fill the cool-down. Written for n = max(m, 2p) micro-batches (DualPipeV needs m >= 2p); for smaller m the actions
// of the missing micro-batches are dropped, which only removes dependencies (the pipeline is then not full). Split
// form: DualPipeV's own mix of B and I/W. Standard form: the same order with every W dropped and I as B.
Schedule dualpipev(const ScheduleOptions& o) {
  check_basic("dualpipev", o);
  const int p = o.ranks, m = o.micro_batches;
  Schedule sc = empty_schedule("dualpipev", p, v_placement("dualpipev", o), m, o.backward);
  const int n = std::max(m, 2 * p);
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    std::map<int, int> next_f, next_b;       // per stage: the next micro-batch of its F, of its I/B
    std::deque<std::pair<int, int>> weights;  // deferred W's (stage, micro-batch), oldest first
    auto& out = sc.actions[r];
    auto emit = [&](ActionType type, int stage, int mb) {
      if (mb < m) out.push_back(Action{type, stage, {mb}});
    };
    auto forward = [&](int stage) { emit(ActionType::kForward, stage, next_f[stage]++); };
    auto backward = [&](int stage, bool split) {
      const int mb = next_b[stage]++;
      emit(split ? ActionType::kBackwardInput : ActionType::kBackward, stage, mb);
      if (split) weights.emplace_back(stage, mb);
    };
    auto weight = [&] {
      if (weights.empty()) return;
      emit(ActionType::kBackwardWeight, weights.front().first, weights.front().second);
      weights.pop_front();
    };
    // F of one stage beside the fused B of the other: an overlapped pair (Action::overlapped_with_next) when both
    // micro-batches exist, else whichever does.
    auto overlapped = [&](int f_stage, int b_stage) {
      const std::size_t at = out.size();
      forward(f_stage);
      const bool have_f = out.size() > at;
      backward(b_stage, false);
      if (have_f && out.size() == at + 2) out[at].overlapped_with_next = true;
    };
    for (int k = 0; k < 2 * (p - r - 1); ++k) forward(c0);  // 1: F0
    for (int k = 0; k < r + 1; ++k) {                          // 2: F0 F1
      forward(c0);
      forward(c1);
    }
    for (int k = 0; k < p - r - 1; ++k) {  // 3: I1 W1 F1
      backward(c1, true);
      weight();
      forward(c1);
    }
    for (int k = 0; k < n - 2 * p + r + 1; ++k) {  // 4: (F0 B1) (F1 B0), the steady state
      if (k == 0 && r == p - 1) {  // the turn of the V: not overlapped, which shortens the bubble (DualPipeV's note)
        forward(c0);
        backward(c1, false);
      } else {
        overlapped(c0, c1);
      }
      overlapped(c1, c0);
    }
    for (int k = 0; k < p - r - 1; ++k) {  // 5: B1 (F1 B0)
      backward(c1, false);
      overlapped(c1, c0);
    }
    bool split = false;  // 6: B1 B0, switching to I's halfway (rank parity decides which chunk switches first)
    for (int k = 0; k < r + 1; ++k) {
      if (k == (r + 1) / 2 && r % 2 == 1) split = true;
      backward(c1, split);
      if (k == (r + 1) / 2 && r % 2 == 0) split = true;
      backward(c0, split);
    }
    for (int k = 0; k < p - r - 1; ++k) {  // 7: W I0
      weight();
      backward(c0, split);
    }
    while (!weights.empty()) weight();  // 8: the remaining W's
  }
  auto order = std::move(sc.actions);
  return finish(std::move(sc), std::move(order));
}

// ---- v-half / v-min (controllable activation memory, Qi et al., arXiv 2405.15362) ---------------------------------

// The paper's schedules are unit-slot plans (detail::v_half_blocks / v_min_blocks, squeezed by detail::squeeze_v;
// controllable_v.h); each rank runs its actions in slot order, the W's where v_weight_slots puts them, and the W's
// still pending after its last I become one batched W per stage (2BP's end-of-step W).
}  // namespace

namespace detail {

Schedule v_schedule_from_slots(std::string_view name, const ScheduleOptions& o, const std::vector<VRankSlots>& slots) {
  check_basic(name, o);
  const int p = o.ranks, m = o.micro_batches;
  TWOBP_CHECK(static_cast<int>(slots.size()) == p, ScheduleError, "internal error: {}: {} ranks of slots for {} ranks",
              name, slots.size(), p);
  Schedule sc = empty_schedule(std::string(name), p, v_placement(name, o), m, o.backward);
  std::vector<std::vector<Action>> order(p);
  for (int r = 0; r < p; ++r) {
    const std::array<int, 2> stage{r, 2 * p - 1 - r};
    std::vector<std::pair<long, Action>> timed;
    for (int kind = 0; kind < 4; ++kind) {
      const int chunk = kind == kVF0 || kind == kVI0 ? 0 : 1;
      const ActionType type = kind <= kVF1 ? ActionType::kForward : ActionType::kBackwardInput;
      for (int mb = 0; mb < m; ++mb) timed.emplace_back(slots[r][kind].at(mb), Action{type, stage[chunk], {mb}});
    }
    std::array<int, 2> next_w{};  // per chunk: the oldest micro-batch without its W
    for (const auto& [slot, chunk] : v_weight_slots(slots[r], false)) {
      timed.emplace_back(slot, Action{ActionType::kBackwardWeight, stage[chunk], {next_w[chunk]++}});
    }
    std::stable_sort(timed.begin(), timed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<Action> in_order;
    for (auto& [slot, action] : timed) in_order.push_back(std::move(action));
    std::deque<std::pair<int, int>> rest;
    for (int c : {1, 0}) {
      for (int mb = next_w[c]; mb < m; ++mb) rest.emplace_back(stage[c], mb);
    }
    append_batched_weights(in_order, rest);
    for (Action& a : in_order) append_joining_weight_runs(order[r], std::move(a));  // W's in free slots in a row
  }
  return finish(std::move(sc), std::move(order));
}

}  // namespace detail

namespace {

Schedule controllable_v(std::string_view name, const ScheduleOptions& o,
                        std::vector<detail::VRankSlots> (*blocks)(int, int)) {
  check_basic(name, o);
  return detail::v_schedule_from_slots(name, o, detail::squeeze_v(blocks(o.ranks, o.micro_batches)));
}

Schedule v_half(const ScheduleOptions& o) { return controllable_v("v-half", o, detail::v_half_blocks); }

Schedule v_min(const ScheduleOptions& o) { return controllable_v("v-min", o, detail::v_min_blocks); }

// ---- registry ----------------------------------------------------------------------------------------------------

class FunctionGenerator : public ScheduleGenerator {
 public:
  FunctionGenerator(std::string name, std::function<Schedule(const ScheduleOptions&)> fn)
      : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  Schedule generate(const ScheduleOptions& options) const override { return fn_(options); }

 private:
  std::string name_;
  std::function<Schedule(const ScheduleOptions&)> fn_;
};

ScheduleInfo builtin(std::string name, Schedule (*fn)(const ScheduleOptions&), int v, std::string summary) {
  ScheduleInfo info;
  info.name = name;
  info.make = [name, fn] { return std::make_unique<FunctionGenerator>(name, fn); };
  info.default_chunks_per_rank = v;
  info.summary = std::move(summary);
  return info;
}

}  // namespace

namespace detail {

std::vector<ScheduleInfo> builtin_schedules() {
  return {
      builtin("gpipe", gpipe, 1, "all F, then all B (or I, then one batched W)"),
      builtin("1f1b", one_f_one_b, 1, "one F one B after a warm-up of p - rank forwards"),
      builtin("interleaved-1f1b", interleaved, 2, "1F1B over v chunks per rank (m in max(1, m/p) groups)"),
      builtin("zb-h1", zb_h1, 1, "zero bubble H1: 1F1B memory, W fills the cool-down"),
      builtin("zb-h2", zb_h2, 1, "zero bubble H2: more warm-up forwards, no bubble"),
      builtin("zb-v", zb_v, 2, "zero bubble V: two chunks per rank in a V"),
      builtin("looped-bfs", looped_bfs, 2, "breadth first over v looped chunks (PyTorch's LoopedBFS)"),
      builtin("interleaved-zb", interleaved_zb, 2,
              "zero bubble over v looped chunks (PyTorch's InterleavedZeroBubble)"),
      builtin("dualpipev", dualpipev, 2, "DeepSeek's DualPipeV: V, F of one micro-batch beside B of another"),
      builtin("v-half", v_half, 2, "V with about half of 1F1B's activation memory"),
      builtin("v-min", v_min, 2, "V with about a third of 1F1B's activation memory"),
      synthesized_schedule_info(),
  };
}

}  // namespace detail
}  // namespace twobp
