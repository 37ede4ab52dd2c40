// Schedule synthesis (twobp/schedule/synthesize.h): list scheduling over a grid of policies, hill climbing on which
// backwards are split, then local search on the action orders; the built-in generators' schedules compete as
// starting points. docs/PERFORMANCE.md ("Synthesized schedules") describes the method.

#include "twobp/schedule/synthesize.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "schedule/dry_run.h"
#include "schedule/generators.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/validate.h"
#include "util/check.h"
#include "util/cost_check.h"

namespace twobp {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNever = std::numeric_limits<double>::max();  // a waiting rank that knows of no arrival
constexpr double kEps = 1e-9;
constexpr std::size_t kNoEnd = std::numeric_limits<std::size_t>::max();

using Orders = std::vector<std::vector<Action>>;  // per rank, compute actions only

// The problem in the form the search reads: placement, per-stage action costs, the budget.
struct Setup {
  int R = 0, S = 0, M = 0;
  std::vector<int> owner;               // stage -> rank
  std::vector<std::vector<int>> local;  // rank -> its stages, ascending
  CostModel costs;
  std::vector<double> f, i, b;          // per stage: F, I, B as simulate() charges them (action_cost)
  double comm = 0.0;
  int budget = 0;
  bool split = true;                    // I + W allowed
  bool shared_channels = false;         // some channel carries several stages (interleaved): check pairing

  std::size_t key(int s, int mb) const { return static_cast<std::size_t>(s) * M + mb; }
  bool cross(int a, int b) const { return owner[a] != owner[b]; }
  // A W of `mbs` micro-batches as simulate() charges it (action_cost): CostModel::per_action once + weight.
  double w(int s, int mbs) const { return costs.per_action + costs.weight(s, mbs); }
  // Channel of a message from stage `from` to stage `to` (kind 0: activation, 1: gradient), as message_channel()
  // splits them: one per (source rank, destination rank, kind).
  int channel(int from, int to, int kind) const { return (owner[from] * R + owner[to]) * 2 + kind; }
};

// ---- evaluation of an order ---------------------------------------------------------------------------------------

// Lexicographic: step time, then the sum of the ranks' end times (a gradient for the search where the step time
// is flat), then peak memory.
struct Score {
  bool ok = false;
  double step = kInf;
  double spread = kInf;
  int peak = 0;
};

bool better(const Score& a, const Score& b) {
  if (a.ok != b.ok) return a.ok;
  if (std::abs(a.step - b.step) > kEps) return a.step < b.step;
  if (std::abs(a.spread - b.spread) > kEps) return a.spread < b.spread;
  return a.peak < b.peak;
}

// Live (chunk, micro-batch) activations of each rank, walking its order: an F adds one, a B or W frees its
// micro-batches (simulate()'s peak_live_micro_batches: a rank's actions run one after the other).
int peak_live(const Orders& orders) {
  int peak = 0;
  for (const auto& list : orders) {
    int live = 0;
    for (const Action& a : list) {
      if (a.type == ActionType::kForward) peak = std::max(peak, ++live);
      if (a.type == ActionType::kBackward) --live;
      if (a.type == ActionType::kBackwardWeight) live -= static_cast<int>(a.micro_batches.size());
    }
  }
  return peak;
}

// Whether every channel's receives come in the order of its sends (validate()'s in-order pairing), given that
// receives sit right before their consumer and sends right after their producer (add_communication()).
bool pairs_in_order(const Setup& P, const Orders& orders) {
  if (!P.shared_channels) return true;  // one stage per channel: increasing micro-batches pair in order
  std::vector<std::vector<std::size_t>> sent(P.R * P.R * 2), received(P.R * P.R * 2);
  for (const auto& list : orders) {
    for (const Action& a : list) {
      const int s = a.stage, mb = a.micro_batches.front();
      if (a.type == ActionType::kForward) {
        if (s + 1 < P.S && P.cross(s, s + 1)) sent[P.channel(s, s + 1, 0)].push_back(P.key(s, mb));
        if (s > 0 && P.cross(s - 1, s)) received[P.channel(s - 1, s, 0)].push_back(P.key(s - 1, mb));
      } else if (a.type != ActionType::kBackwardWeight) {
        if (s > 0 && P.cross(s, s - 1)) sent[P.channel(s, s - 1, 1)].push_back(P.key(s, mb));
        if (s + 1 < P.S && P.cross(s + 1, s)) received[P.channel(s + 1, s, 1)].push_back(P.key(s + 1, mb));
      }
    }
  }
  return sent == received;
}

// Runs `orders` as simulate() does a compute-only schedule: each rank in its order, an action once the rank is
// free and its inputs are there (from another rank `comm` after their producer ended). Not ok when it deadlocks,
// exceeds the budget, would not pair in order, or (to stop early) a rank runs past `cutoff`.
Score evaluate(const Setup& P, const Orders& orders, double cutoff = kInf) {
  Score score;
  score.peak = peak_live(orders);
  if (score.peak > P.budget || !pairs_in_order(P, orders)) return score;
  const std::size_t n = static_cast<std::size_t>(P.S) * P.M;
  std::vector<double> f_end(n, -1.0), b_end(n, -1.0), i_end(n, -1.0);
  std::vector<std::size_t> pos(P.R, 0);
  std::vector<double> clock(P.R, 0.0);
  auto arrival = [&](const std::vector<double>& ends, int from, int to, int mb) {
    const double t = ends[P.key(from, mb)];
    return t < 0.0 ? -1.0 : t + (P.cross(from, to) ? P.comm : 0.0);
  };
  // When `a` can start on its rank, or < 0 while an input is missing.
  auto ready = [&](int r, const Action& a) {
    double t = clock[r];
    const int s = a.stage;
    for (int mb : a.micro_batches) {
      double in = 0.0;
      if (a.type == ActionType::kForward) {
        in = s > 0 ? arrival(f_end, s - 1, s, mb) : 0.0;
      } else if (a.type == ActionType::kBackwardWeight) {
        in = i_end[P.key(s, mb)];
      } else {
        in = f_end[P.key(s, mb)];
        if (in >= 0.0 && s + 1 < P.S) in = arrival(b_end, s + 1, s, mb);
      }
      if (in < 0.0) return -1.0;
      t = std::max(t, in);
    }
    return t;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P.R; ++r) {
      for (; pos[r] < orders[r].size(); ++pos[r], progress = true) {
        const Action& a = orders[r][pos[r]];
        const double start = ready(r, a);
        if (start < 0.0) break;
        clock[r] = start + action_cost(a, P.costs);
        if (clock[r] > cutoff + kEps) return Score{false, kInf, kInf, score.peak};
        const std::size_t k = P.key(a.stage, a.micro_batches.front());
        if (a.type == ActionType::kForward) f_end[k] = clock[r];
        if (a.type == ActionType::kBackwardInput) i_end[k] = b_end[k] = clock[r];
        if (a.type == ActionType::kBackward) b_end[k] = clock[r];
      }
    }
  }
  score.step = score.spread = 0.0;
  for (int r = 0; r < P.R; ++r) {
    if (pos[r] < orders[r].size()) return Score{false, kInf, kInf, score.peak};
    score.step = std::max(score.step, clock[r]);
    score.spread += clock[r];
  }
  score.ok = true;
  return score;
}

// ---- list scheduling ----------------------------------------------------------------------------------------------

// How the list scheduler chooses when several actions could run.
struct Policy {
  std::vector<char> split;          // per (stage, micro-batch): 1 = I + W, 0 = fused B
  int backward_pick = 0;            // 0: gradient arrived first, 1: highest stage, 2: lowest stage
  int forward_pick = 0;             // 0: highest stage (closest to the loss), 1: lowest stage, 2: input arrived first
  bool yield_to_backward = false;   // rather idle than start a W that a known arrival's backward would wait for
  int reserve = 1;                  // an F on a rank's chunk c leaves this many slots per later chunk of the rank
  int slack = 0;                    // F's keep this many slots of the budget free
  std::vector<int> cap;             // per stage: most micro-batches past its F and before its backward (empty: none)
};

// Event-driven list scheduling: the rank that is earliest in time decides next; it runs a ready backward, else a
// ready F within the budget, else its oldest pending W, else waits for the next known arrival. Every stage runs
// its F's and its backwards in increasing micro-batch order, and a rank takes the messages of a channel in the
// order they were sent (so that the result pairs in order on NCCL-like transports).
class ListScheduler {
 public:
  ListScheduler(const Setup& P, const Policy& policy)
      : P_(P), pol_(policy), f_end_(P.S * P.M, -1.0), b_end_(f_end_.size(), -1.0), next_f_(P.S, 0),
        next_b_(P.S, 0), clock_(P.R, 0.0), wake_(P.R, 0.0), waiting_(P.R, false), done_(P.R, false), live_(P.R, 0),
        key_(P.R, 0.0), pending_(P.R), sent_(P.R * P.R * 2), head_(sent_.size(), 0), orders_(P.R) {}

  std::optional<Orders> run() {
    for (int q = 0; q < P_.R; ++q) requeue(q);
    while (true) {
      // The rank that decides next: the earliest (ties: the lower rank); finished ranks have key kInf.
      const int r = static_cast<int>(std::min_element(key_.begin(), key_.end()) - key_.begin());
      const double t = key_[r];
      if (t == kInf) break;
      if (t == kNever) return std::nullopt;  // every rank waits for something that never comes
      clock_[r] = std::max(clock_[r], t);
      waiting_[r] = false;
      decide(r);
      requeue(r);
    }
    return std::move(orders_);
  }

 private:
  struct Pick {
    int stage = -1;
    double arrival = kInf;
  };

  // When rank q decides next.
  void requeue(int q) { key_[q] = done_[q] ? kInf : !waiting_[q] ? clock_[q] : wake_[q] < kInf ? wake_[q] : kNever; }
  bool finished(int r) const {
    for (int s : P_.local[r]) {
      if (next_f_[s] < P_.M || next_b_[s] < P_.M) return false;
    }
    return pending_[r].empty();
  }
  bool at_head(int from, int to, int kind, int mb) const {
    if (!P_.cross(from, to)) return true;
    const int c = P_.channel(from, to, kind);
    return head_[c] < sent_[c].size() && sent_[c][head_[c]] == P_.key(to, mb);
  }
  // Arrival of the input of stage s's next backward (kInf: not yet produced, or not its channel's turn).
  double backward_input(int s) const {
    const int mb = next_b_[s];
    if (mb >= P_.M || next_f_[s] <= mb) return kInf;
    if (s + 1 == P_.S) return f_end_[P_.key(s, mb)];
    const double t = b_end_[P_.key(s + 1, mb)];
    if (t < 0.0 || !at_head(s + 1, s, 1, mb)) return kInf;
    return t + (P_.cross(s, s + 1) ? P_.comm : 0.0);
  }
  double forward_input(int s) const {
    const int mb = next_f_[s];
    if (mb >= P_.M) return kInf;
    if (s == 0) return 0.0;
    const double t = f_end_[P_.key(s - 1, mb)];
    if (t < 0.0 || !at_head(s - 1, s, 0, mb)) return kInf;
    return t + (P_.cross(s - 1, s) ? P_.comm : 0.0);
  }
  bool memory_allows(int r, int s) const {
    if (!pol_.cap.empty() && next_f_[s] - next_b_[s] >= pol_.cap[s]) return false;
    const auto& mine = P_.local[r];
    const int later = static_cast<int>(mine.end() - std::upper_bound(mine.begin(), mine.end(), s));
    return live_[r] + 1 + pol_.reserve * later <= P_.budget - pol_.slack ||
           (later == 0 && live_[r] + 1 <= P_.budget);
  }
  bool prefer(int rule, const Pick& a, int s, double arrival) const {
    if (a.stage < 0) return true;
    if (rule == 0 && arrival != a.arrival) return arrival < a.arrival;
    return rule == 2 ? s < a.stage : s > a.stage;
  }

  void decide(int r);
  void emit(int r, Action a);

  const Setup& P_;
  const Policy& pol_;
  std::vector<double> f_end_, b_end_;
  std::vector<int> next_f_, next_b_;
  std::vector<double> clock_, wake_;
  std::vector<bool> waiting_;
  std::vector<bool> done_;
  std::vector<int> live_;
  std::vector<double> key_;
  std::vector<std::vector<std::pair<int, int>>> pending_;  // per rank: (stage, micro-batch) after its I, oldest first
  std::vector<std::vector<std::size_t>> sent_;               // per channel: the messages' receiving keys, in order
  std::vector<std::size_t> head_;                            // per channel: the next message to take
  Orders orders_;
};

// One decision of rank r at its clock: runs an action, or waits until its next known arrival or until a rank
// sends it something (emit() wakes the receiver).
void ListScheduler::decide(int r) {
  const double t = clock_[r];
  Pick bwd, fwd;
  double next_arrival = kInf, next_backward = kInf;
  for (int s : P_.local[r]) {
    const double b = backward_input(s);
    if (b <= t + kEps && prefer(pol_.backward_pick, bwd, s, b)) bwd = {s, b};
    if (b > t + kEps) next_backward = std::min(next_backward, b);
    const double f = forward_input(s);
    const int fwd_rule = pol_.forward_pick == 1 ? 2 : pol_.forward_pick == 0 ? 1 : 0;
    if (f <= t + kEps && memory_allows(r, s) && prefer(fwd_rule, fwd, s, f)) fwd = {s, f};
    if (f > t + kEps && memory_allows(r, s)) next_arrival = std::min(next_arrival, f);
  }
  next_arrival = std::min(next_arrival, next_backward);
  if (bwd.stage >= 0) {
    const int s = bwd.stage, mb = next_b_[s];
    const bool split = P_.split && pol_.split[P_.key(s, mb)];
    emit(r, Action{split ? ActionType::kBackwardInput : ActionType::kBackward, s, {mb}});
    return;
  }
  if (fwd.stage >= 0) {
    emit(r, Action{ActionType::kForward, fwd.stage, {next_f_[fwd.stage]}});
    return;
  }
  if (!pending_[r].empty()) {
    const auto [s, mb] = pending_[r].front();
    if (!(pol_.yield_to_backward && next_backward < t + P_.w(s, 1) - kEps)) {
      emit(r, Action{ActionType::kBackwardWeight, s, {mb}});
      return;
    }
  }
  waiting_[r] = true;
  wake_[r] = next_arrival;
}

void ListScheduler::emit(int r, Action a) {
  const int s = a.stage, mb = a.micro_batches.front();
  const std::size_t k = P_.key(s, mb);
  const double end = clock_[r] + action_cost(a, P_.costs);
  switch (a.type) {
    case ActionType::kForward:
      f_end_[k] = end;
      ++live_[r];
      ++next_f_[s];
      if (s > 0 && P_.cross(s - 1, s)) ++head_[P_.channel(s - 1, s, 0)];
      if (s + 1 < P_.S && P_.cross(s, s + 1)) sent_[P_.channel(s, s + 1, 0)].push_back(P_.key(s + 1, mb));
      break;
    case ActionType::kBackwardWeight:
      --live_[r];
      pending_[r].erase(pending_[r].begin());
      break;
    default:  // I or B
      b_end_[k] = end;
      ++next_b_[s];
      if (a.type == ActionType::kBackward) --live_[r];
      if (a.type == ActionType::kBackwardInput) pending_[r].emplace_back(s, mb);
      if (s + 1 < P_.S && P_.cross(s + 1, s)) ++head_[P_.channel(s + 1, s, 1)];
      if (s > 0 && P_.cross(s, s - 1)) sent_[P_.channel(s, s - 1, 1)].push_back(P_.key(s - 1, mb));
  }
  // The rank that consumes the output is the only one with news (a waiting rank re-decides).
  int consumer = -1;
  if (a.type == ActionType::kForward && s + 1 < P_.S) consumer = P_.owner[s + 1];
  if ((a.type == ActionType::kBackwardInput || a.type == ActionType::kBackward) && s > 0) consumer = P_.owner[s - 1];
  if (consumer >= 0 && consumer != r) {
    waiting_[consumer] = false;
    requeue(consumer);
  }
  clock_[r] = end;
  orders_[r].push_back(std::move(a));
  done_[r] = finished(r);
}

// Adjacent W's of one stage become one batched W (as 2BP's end-of-step W: one GEMM over several micro-batches);
// with a fixed part per W this is faster, and it frees nothing later than an F could start.
void batch_adjacent_weights(Orders& orders) {
  for (auto& list : orders) {
    std::vector<Action> out;
    for (Action& a : list) {
      if (a.type == ActionType::kBackwardWeight && !out.empty() && out.back().type == ActionType::kBackwardWeight &&
          out.back().stage == a.stage) {
        out.back().micro_batches.insert(out.back().micro_batches.end(), a.micro_batches.begin(),
                                        a.micro_batches.end());
        continue;
      }
      out.push_back(std::move(a));
    }
    list = std::move(out);
  }
}

// ---- moves of the local search (each edits one rank's order; can_*() say whether it applies) ----------------

// Where the W of `list[k]` (an I) is: (index, position of its micro-batch in it), or index == list.size().
std::pair<std::size_t, std::size_t> weight_of(const std::vector<Action>& list, std::size_t k) {
  const Action& a = list[k];
  const int mb = a.micro_batches.front();
  for (std::size_t j = k + 1; j < list.size(); ++j) {
    const Action& w = list[j];
    if (w.type != ActionType::kBackwardWeight || w.stage != a.stage) continue;
    auto it = std::find(w.micro_batches.begin(), w.micro_batches.end(), mb);
    if (it != w.micro_batches.end()) return {j, static_cast<std::size_t>(it - w.micro_batches.begin())};
  }
  return {list.size(), 0};
}

// Whether refuse(list, k) applies: a B where I + W are allowed, or an I whose W follows on the rank.
bool can_refuse(const std::vector<Action>& list, std::size_t k, bool split_allowed) {
  if (list[k].type == ActionType::kBackward) return split_allowed;
  return list[k].type == ActionType::kBackwardInput && weight_of(list, k).first < list.size();
}

// B into I and a W of its micro-batch right after; or I into B, its micro-batch taken out of its W.
void refuse(std::vector<Action>& list, std::size_t k) {
  Action& a = list[k];
  if (a.type == ActionType::kBackward) {
    a.type = ActionType::kBackwardInput;
    list.insert(list.begin() + k + 1, Action{ActionType::kBackwardWeight, a.stage, {a.micro_batches.front()}});
    return;
  }
  const auto [j, at] = weight_of(list, k);
  a.type = ActionType::kBackward;
  auto& mbs = list[j].micro_batches;
  mbs.erase(mbs.begin() + at);
  if (mbs.empty()) list.erase(list.begin() + j);
}

// Which actions of a stage keep their micro-batch order: F's (0), I's and B's (1); W's (2) move freely.
int order_class(const Action& a) {
  return a.type == ActionType::kForward ? 0 : a.type == ActionType::kBackwardWeight ? 2 : 1;
}

// Whether action k may move by d places (d != 0): within the list, and passing no action of its stage and order
// class (a stage runs its F's, and its backwards, in increasing micro-batch order). The evaluation rejects a W
// moved before its I.
bool can_move(const std::vector<Action>& list, std::size_t k, int d) {
  const long to = static_cast<long>(k) + d;
  if (d == 0 || to < 0 || to >= static_cast<long>(list.size())) return false;
  const Action& a = list[k];
  if (order_class(a) == 2) return true;
  for (long j = std::min<long>(k, to); j <= std::max<long>(k, to); ++j) {
    if (j != static_cast<long>(k) && list[j].stage == a.stage && order_class(list[j]) == order_class(a)) return false;
  }
  return true;
}

void move_to(std::vector<Action>& list, std::size_t k, int d) {
  Action moved = std::move(list[k]);
  list.erase(list.begin() + k);
  list.insert(list.begin() + static_cast<long>(k) + d, std::move(moved));
}

// ---- the search ---------------------------------------------------------------------------------------------------

struct Candidate {
  Orders orders;
  Score score;
  std::string origin;
};

class Search {
 public:
  Search(const Setup& P, const SynthesisOptions& o) : P_(P), total_(o.max_work) {
    for (int s = 0; s < P.S; ++s) actions_ += P.M * (P.split ? 3 : 2);  // F, I, W per micro-batch
  }

  int evaluations() const { return evaluations_; }
  std::int64_t actions() const { return actions_; }
  std::int64_t left() const { return total_ - work_; }
  bool exhausted() const { return work_ >= total_ || work_ >= share_end_; }
  /// Limits the next steps to `work` more (within the total).
  void set_share(std::int64_t work) { share_end_ = work_ + std::max<std::int64_t>(work, 1); }

  Score score(const Orders& orders, double cutoff = kInf) {
    charge();
    return evaluate(P_, orders, cutoff);
  }
  std::optional<Candidate> list_schedule(const Policy& policy) {
    charge();
    std::optional<Orders> orders = ListScheduler(P_, policy).run();
    if (!orders) return std::nullopt;
    batch_adjacent_weights(*orders);
    Candidate c{std::move(*orders), {}, "list scheduling"};
    c.score = evaluate(P_, c.orders);
    if (!c.score.ok) return std::nullopt;
    return c;
  }

  Candidate best_list_schedule();
  bool climb_caps(Policy& policy, Candidate& best);
  bool climb_splits(Policy& policy, Candidate& best);
  void improve_order(Candidate& best, const std::vector<std::pair<int, std::size_t>>& focus = {});
  void iterate(Candidate& best);

 private:
  void charge() {
    ++evaluations_;
    work_ += actions_;
  }

  const Setup& P_;
  std::int64_t total_ = 0, work_ = 0, actions_ = 0;
  std::int64_t share_end_ = std::numeric_limits<std::int64_t>::max();
  int evaluations_ = 0;
};

// Which backwards start split: none, all, or the last k micro-batches of every stage (where the cool-down's gaps
// are that W's fill).
std::vector<std::vector<char>> split_patterns(const Setup& P) {
  std::vector<std::vector<char>> patterns{std::vector<char>(P.S * P.M, 0)};
  if (!P.split) return patterns;
  for (int k : {P.M, 1, std::max(1, P.R / 2), P.R, 2 * P.R}) {
    std::vector<char> p(P.S * P.M, 0);
    for (int s = 0; s < P.S; ++s) {
      for (int mb = std::max(0, P.M - k); mb < P.M; ++mb) p[P.key(s, mb)] = 1;
    }
    if (std::find(patterns.begin(), patterns.end(), p) == patterns.end()) patterns.push_back(std::move(p));
  }
  return patterns;
}

// The best list schedule over a grid of policies, the split patterns varied first (so that a search cut short
// has tried each pattern with the plainest rules), then its caps and splits climbed.
Candidate Search::best_list_schedule() {
  Candidate best;
  Policy best_policy;
  const std::vector<std::vector<char>> patterns = split_patterns(P_);
  const int reserves = P_.S > P_.R ? 2 : 1;  // reserve matters only with several chunks per rank
  const int points = static_cast<int>(patterns.size()) * 3 * 3 * 2 * reserves * 2;
  for (int k = 0; k < points && !exhausted(); ++k) {
    int digits = k;
    auto digit = [&](int radix) {
      const int d = digits % radix;
      digits /= radix;
      return d;
    };
    Policy policy;
    policy.split = patterns[digit(static_cast<int>(patterns.size()))];
    policy.backward_pick = digit(3);
    policy.forward_pick = digit(3);
    policy.yield_to_backward = digit(2) == 1;
    policy.reserve = reserves == 2 ? 1 + digit(2) : 0;
    policy.slack = digit(2);
    std::optional<Candidate> c = list_schedule(policy);
    if (c && better(c->score, best.score)) best = std::move(*c), best_policy = policy;
  }
  if (!best.score.ok) return best;
  best_policy.cap.assign(P_.S, P_.M);
  for (bool improved = true; improved && !exhausted();) {
    improved = climb_caps(best_policy, best);
    improved = climb_splits(best_policy, best) || improved;
  }
  return best;
}

// Coordinate descent on each stage's cap of micro-batches between its F and its backward (a 1F1B warm-up per
// chunk): every value from 1 to the budget, keep the best; passes until none helps.
bool Search::climb_caps(Policy& policy, Candidate& best) {
  bool any = false;
  for (bool improved = true; improved && !exhausted();) {
    improved = false;
    for (int s = 0; s < P_.S && !exhausted(); ++s) {
      const int kept = policy.cap[s];
      for (int cap = 1; cap <= std::min(P_.budget, P_.M) && !exhausted(); ++cap) {
        if (cap == kept) continue;
        policy.cap[s] = cap;
        std::optional<Candidate> c = list_schedule(policy);
        if (c && better(c->score, best.score)) {
          best = std::move(*c);
          improved = any = true;
          break;
        }
        policy.cap[s] = kept;
      }
    }
  }
  return any;
}

// Hill climbing on the fused/split choice of each backward: flip one, list-schedule again, keep it if better;
// passes until none helps or the evaluations run out.
bool Search::climb_splits(Policy& policy, Candidate& best) {
  if (!P_.split) return false;
  bool any = false;
  for (bool improved = true; improved && !exhausted();) {
    improved = false;
    for (std::size_t k = 0; k < policy.split.size() && !exhausted(); ++k) {
      policy.split[k] ^= 1;
      std::optional<Candidate> c = list_schedule(policy);
      if (c && better(c->score, best.score)) {
        best = std::move(*c);
        improved = any = true;
      } else {
        policy.split[k] ^= 1;
      }
    }
  }
  return any;
}

// Local search on the orders, first improvement: for each action of each rank (of the positions within kRadius of
// `focus`, when given), try fusing it (an I with its W, into B) or splitting it (a B into I and a W right after),
// and moving it up to kWindow places either way; keep a change when the score improves. Passes until none does
// or the evaluations run out.
void Search::improve_order(Candidate& best, const std::vector<std::pair<int, std::size_t>>& focus) {
  constexpr int kWindow = 6;
  constexpr std::size_t kRadius = 10;
  std::vector<std::pair<std::size_t, std::size_t>> range(P_.R, {0, focus.empty() ? kNoEnd : 0});
  for (const auto& [r, k] : focus) {
    auto& [lo, hi] = range[r];
    lo = hi == 0 ? (k > kRadius ? k - kRadius : 0) : std::min(lo, k > kRadius ? k - kRadius : 0);
    hi = std::max(hi, k + kRadius + 1);
  }
  for (bool improved = true; improved && !exhausted();) {
    improved = false;
    for (int r = 0; r < P_.R && !exhausted(); ++r) {
      auto& list = best.orders[r];
      for (std::size_t k = range[r].first; k < std::min(list.size(), range[r].second) && !exhausted(); ++k) {
        // Applies `move` (when `applies`) to the rank's order and keeps it when the score improves.
        auto attempt = [&](bool applies, auto&& move) {
          if (!applies) return false;
          std::vector<Action> kept = list;
          move(list);
          const Score s = score(best.orders, best.score.step);
          if (better(s, best.score)) {
            best.score = s;
            improved = true;
            return true;
          }
          list = std::move(kept);
          return false;
        };
        if (attempt(can_refuse(list, k, P_.split), [&](auto& l) { refuse(l, k); })) continue;
        for (int d = 1; d <= kWindow; ++d) {
          if (attempt(can_move(list, k, d), [&](auto& l) { move_to(l, k, d); }) ||
              attempt(can_move(list, k, -d), [&](auto& l) { move_to(l, k, -d); })) {
            break;
          }
        }
      }
    }
  }
}

// Iterated local search: a few random moves on the best order (a fixed-seed generator, so the result is
// deterministic), local search around them, and the result kept when better; until the evaluations run out.
void Search::iterate(Candidate& best) {
  std::uint64_t state = 0x2545F4914F6CDD1DULL;
  auto draw = [&](std::uint64_t n) {  // splitmix64
    state += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return static_cast<long>((z ^ (z >> 31)) % n);
  };
  Candidate current = best;
  while (!exhausted()) {
    Candidate trial = current;
    std::vector<std::pair<int, std::size_t>> moved;
    for (long moves = 2 + draw(4); moves > 0; --moves) {
      const int r = static_cast<int>(draw(P_.R));
      auto& list = trial.orders[r];
      if (list.empty()) continue;
      const std::size_t k = draw(list.size());
      moved.emplace_back(r, k);
      const int d = static_cast<int>(draw(12)) - 6;
      if (draw(3) == 0) {
        if (can_refuse(list, k, P_.split)) refuse(list, k);
      } else if (can_move(list, k, d)) {
        move_to(list, k, d);
      }
    }
    trial.score = score(trial.orders);
    if (!trial.score.ok) continue;
    improve_order(trial, moved);
    if (better(trial.score, best.score)) best = trial;
    // Walks on along the plateau: a step time no longer than the current one is taken whatever its spread.
    if (trial.score.step <= current.score.step + kEps) current = std::move(trial);
  }
}

// ---- starting points from the generators --------------------------------------------------------------------------

Orders compute_orders(const Schedule& sc) {
  Orders orders(sc.actions.size());
  for (std::size_t r = 0; r < sc.actions.size(); ++r) {
    for (Action a : sc.actions[r]) {
      if (!is_compute(a.type)) continue;
      a.overlapped_with_next = false;  // the search runs pairs one after the other, as the executor does by default
      orders[r].push_back(std::move(a));
    }
  }
  return orders;
}

// Every built-in generator's schedule (both forms) of the problem's placement that fits the budget.
std::vector<Candidate> generator_candidates(const Setup& P) {
  std::vector<Candidate> out;
  const int v = P.S / P.R;
  for (const std::string& name : builtin_schedule_names()) {
    if (name == "synth") continue;
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      if (mode == BackwardMode::kSplit && !P.split) continue;
      Schedule sc;
      try {
        sc = make_schedule_generator(name)->generate(ScheduleOptions{P.R, P.M, v, mode});
      } catch (const ScheduleError&) {
        continue;  // the generator does not take this shape
      }
      if (sc.stage_to_rank != P.owner) continue;
      Candidate c{compute_orders(sc), {}, fmt::format("{} {}", name, to_string(mode))};
      c.score = evaluate(P, c.orders);
      if (c.score.ok) out.push_back(std::move(c));
    }
  }
  return out;
}

// ---- the problem --------------------------------------------------------------------------------------------------

void check_costs(const CostModel& c, int S) {
  auto sized = [&](const std::vector<double>& v, const char* what, bool may_be_empty) {
    TWOBP_CHECK(static_cast<int>(v.size()) == S || (may_be_empty && v.empty()), UsageError,
                "synthesize: CostModel.{} has {} entries, expected one per stage ({})", what, v.size(), S);
  };
  sized(c.forward, "forward", false);
  sized(c.backward_input, "backward_input", false);
  sized(c.backward_weight, "backward_weight", false);
  sized(c.backward, "backward", true);
  sized(c.backward_weight_fixed, "backward_weight_fixed", true);
  sized(c.recompute, "recompute", true);
  detail::check_cost_model(c, "synthesize");
}

Setup make_setup(const SynthesisProblem& problem) {
  Setup P;
  P.owner = synthesis_placement(problem.placement, problem.ranks, problem.chunks_per_rank);
  TWOBP_CHECK(problem.micro_batches >= 1, ScheduleError, "synthesize: expected at least 1 micro-batch, got {}",
              problem.micro_batches);
  P.R = problem.ranks;
  P.S = static_cast<int>(P.owner.size());
  P.M = problem.micro_batches;
  P.local.resize(P.R);
  for (int s = 0; s < P.S; ++s) P.local[P.owner[s]].push_back(s);
  P.costs = problem.costs;
  if (P.costs.forward.empty()) {
    P.costs = CostModel::uniform(P.S, 1.0, 1.0, 1.0);
    P.costs.backward.assign(P.S, 2.0);
    P.costs.per_action = problem.costs.per_action;  // textbook chunks, with the fixed cost asked for
  }
  check_costs(P.costs, P.S);
  P.costs.overlap = 0.0;  // the result has no overlapped pairs
  P.comm = P.costs.communication;
  const int v = P.S / P.R;
  TWOBP_CHECK(problem.memory_budget >= 0, ScheduleError,
              "synthesize: SynthesisProblem.memory_budget is {}, expected 0 (1F1B standard's peak) or at least the {} "
              "chunks of a rank",
              problem.memory_budget, v);
  P.budget = problem.memory_budget > 0 ? problem.memory_budget : v * std::min(P.R, P.M);
  TWOBP_CHECK(P.budget >= v, ScheduleError,
              "synthesize: a memory budget of {} activations per rank is below the {} chunks of a rank, which one "
              "micro-batch needs at once",
              P.budget, v);
  P.split = problem.backward == BackwardMode::kSplit;
  for (int s = 0; s < P.S; ++s) {
    P.f.push_back(action_cost(Action{ActionType::kForward, s, {0}}, P.costs));
    P.i.push_back(action_cost(Action{ActionType::kBackwardInput, s, {0}}, P.costs));
    P.b.push_back(action_cost(Action{ActionType::kBackward, s, {0}}, P.costs));
  }
  std::vector<int> stage_on_channel(P.R * P.R * 2, -1);
  for (int s = 0; s + 1 < P.S; ++s) {
    if (!P.cross(s, s + 1)) continue;
    int& seen = stage_on_channel[P.channel(s, s + 1, 0)];
    P.shared_channels = P.shared_channels || (seen >= 0 && seen != s);
    seen = s;
  }
  return P;
}

// A lower bound on the step time (docs/PERFORMANCE.md): each rank idles until the first input of its first stage
// can arrive, then works through every micro-batch's F and cheapest backward (a W batched over all micro-batches);
// and no micro-batch is done before its F's and backwards have run one after the other.
double lower_bound(const Setup& P) {
  auto hop = [&](int s) { return s + 1 < P.S && P.cross(s, s + 1) ? P.comm : 0.0; };
  auto backward = [&](int s) { return P.split ? std::min(P.b[s], P.i[s] + P.w(s, P.M) / P.M) : P.b[s]; };
  std::vector<double> first(P.S, 0.0);  // earliest arrival of stage s's first input
  for (int s = 1; s < P.S; ++s) first[s] = first[s - 1] + P.f[s - 1] + hop(s - 1);
  double bound = 0.0, path = first[P.S - 1];
  for (int s = 0; s < P.S; ++s) path += (s + 1 == P.S ? P.f[s] : 0.0) + backward(s) + (s > 0 ? hop(s - 1) : 0.0);
  for (int r = 0; r < P.R; ++r) {
    double work = 0.0;
    for (int s : P.local[r]) work += P.M * (P.f[s] + backward(s));
    bound = std::max(bound, first[P.local[r].front()] + work);
  }
  return std::max(bound, path);
}

Schedule assemble(const Setup& P, BackwardMode mode, Orders orders) {
  Schedule sc;
  sc.name = "synth";
  sc.num_ranks = P.R;
  sc.num_stages = P.S;
  sc.num_micro_batches = P.M;
  sc.backward = mode;
  sc.stage_to_rank = P.owner;
  sc.actions = std::move(orders);
  return add_communication(std::move(sc));
}

}  // namespace

const char* to_string(SynthesisPlacement placement) {
  switch (placement) {
    case SynthesisPlacement::kLinear:
      return "linear";
    case SynthesisPlacement::kInterleaved:
      return "interleaved";
    case SynthesisPlacement::kV:
      return "v";
  }
  return "?";
}

std::vector<int> synthesis_placement(SynthesisPlacement placement, int ranks, int chunks_per_rank) {
  TWOBP_CHECK(ranks >= 1, ScheduleError, "synthesize: expected at least 1 rank, got {}", ranks);
  const int v = placement == SynthesisPlacement::kLinear ? 1
                : placement == SynthesisPlacement::kV     ? 2
                                                          : chunks_per_rank;
  TWOBP_CHECK(v >= 1, ScheduleError, "synthesize: expected at least 1 chunk per rank, got {}", v);
  std::vector<int> owner(static_cast<std::size_t>(ranks) * v);
  for (int s = 0; s < ranks * v; ++s) {
    owner[s] = placement == SynthesisPlacement::kV && s >= ranks ? 2 * ranks - 1 - s : s % ranks;
  }
  return owner;
}

SynthesisResult synthesize(const SynthesisProblem& problem, const SynthesisOptions& options) {
  const Setup P = make_setup(problem);
  Search search(P, options);
  std::vector<Candidate> pool;
  search.set_share(search.left() * 3 / 10);  // list scheduling; then local search from the best starts, then ILS
  Candidate listed = search.best_list_schedule();
  if (listed.score.ok) pool.push_back(std::move(listed));
  if (options.from_generators) {
    for (Candidate& c : generator_candidates(P)) pool.push_back(std::move(c));
  }
  TWOBP_CHECK(!pool.empty(), ScheduleError,
              "synthesize: no schedule for p={} m={} on the {} placement fits a budget of {} activations per rank",
              P.R, P.M, to_string(problem.placement), P.budget);
  std::stable_sort(pool.begin(), pool.end(), [](const Candidate& a, const Candidate& b) {
    return better(a.score, b.score);
  });
  // Local search from the best starting points: as many (1 to 4) as get two passes each with half of what is left
  // (a pass tries some 13 moves per action); then iterated local search on the best with the rest.
  const std::int64_t for_starts = search.left() / 2;
  const std::int64_t pass = 13 * search.actions() * search.actions();
  const int starts = static_cast<int>(
      std::min<std::int64_t>(std::clamp<std::int64_t>(for_starts / (2 * pass), 1, 4), pool.size()));
  for (int k = 0; k < starts; ++k) {
    search.set_share(for_starts / starts);
    const Score initial = pool[k].score;
    search.improve_order(pool[k]);
    if (better(pool[k].score, initial)) pool[k].origin += " + local search";
  }
  std::stable_sort(pool.begin(), pool.begin() + starts, [](const Candidate& a, const Candidate& b) {
    return better(a.score, b.score);
  });
  Candidate& best = pool.front();
  search.set_share(search.left());
  const Score searched = best.score;
  search.iterate(best);
  if (better(best.score, searched)) best.origin += " + iterated local search";

  SynthesisResult result;
  result.schedule = assemble(P, problem.backward, std::move(best.orders));
  validate(result.schedule, Pairing::kInOrderPerChannel);
  result.simulated = simulate(result.schedule, P.costs);
  result.origin = best.origin;
  result.evaluations = search.evaluations();
  result.memory_budget = P.budget;
  result.lower_bound = lower_bound(P);
  return result;
}

Schedule synthesize_schedule(const SynthesisProblem& problem, const SynthesisOptions& options) {
  return synthesize(problem, options).schedule;
}

std::vector<SynthesisPlacement> synthesis_placements(int chunks_per_rank) {
  if (chunks_per_rank == 1) return {SynthesisPlacement::kLinear};
  if (chunks_per_rank == 2) return {SynthesisPlacement::kV, SynthesisPlacement::kInterleaved};
  return {SynthesisPlacement::kInterleaved};
}

SynthesizedScheduleGenerator::SynthesizedScheduleGenerator(RankCosts costs, int memory_budget_per_rank,
                                                           SynthesisOptions options)
    : SynthesizedScheduleGenerator(
          [costs](const std::vector<int>& stage_to_rank) {
            const int ranks = *std::max_element(stage_to_rank.begin(), stage_to_rank.end()) + 1;
            return costs.per_stage(static_cast<int>(stage_to_rank.size()), ranks);
          },
          memory_budget_per_rank, options) {}

SynthesizedScheduleGenerator::SynthesizedScheduleGenerator(CostsFor costs_for, int memory_budget_per_rank,
                                                           SynthesisOptions options)
    : costs_for_(std::move(costs_for)), memory_budget_per_rank_(memory_budget_per_rank), options_(options) {}

SynthesisResult SynthesizedScheduleGenerator::synthesize(const ScheduleOptions& o,
                                                         const std::vector<int>& only_stage_to_rank) const {
  TWOBP_CHECK(o.ranks >= 1 && o.micro_batches >= 1 && o.chunks_per_rank >= 1, ScheduleError,
              "synth: expected ranks, micro_batches and chunks_per_rank >= 1, got {}, {} and {}", o.ranks,
              o.micro_batches, o.chunks_per_rank);
  std::optional<SynthesisResult> best;
  for (SynthesisPlacement placement : synthesis_placements(o.chunks_per_rank)) {
    if (!only_stage_to_rank.empty() &&
        synthesis_placement(placement, o.ranks, o.chunks_per_rank) != only_stage_to_rank) {
      continue;
    }
    SynthesisProblem p;
    p.ranks = o.ranks;
    p.micro_batches = o.micro_batches;
    p.placement = placement;
    p.chunks_per_rank = o.chunks_per_rank;
    p.costs = costs_for_(synthesis_placement(placement, o.ranks, o.chunks_per_rank));
    p.memory_budget = memory_budget_per_rank_ * o.chunks_per_rank;
    p.backward = o.backward;
    SynthesisResult r = twobp::synthesize(p, options_);
    if (!best || r.simulated.step_time < best->simulated.step_time - kEps) best = std::move(r);
  }
  TWOBP_CHECK(best.has_value(), ScheduleError,
              "synth: no placement of {} ranks with {} chunks each has the stage_to_rank asked for", o.ranks,
              o.chunks_per_rank);
  return std::move(*best);
}

Schedule SynthesizedScheduleGenerator::generate(const ScheduleOptions& options) const {
  return synthesize(options).schedule;
}

Schedule make_schedule_for_costs(const std::string& name, const ScheduleOptions& options,
                                 const SynthesizedScheduleGenerator::CostsFor& costs_for,
                                 const SynthesisOptions& synthesis, const std::vector<int>& only_stage_to_rank) {
  if (name != detail::synthesized_schedule_info().name) return make_schedule(name, options);
  return SynthesizedScheduleGenerator(costs_for, 0, synthesis).synthesize(options, only_stage_to_rank).schedule;
}

namespace detail {

ScheduleInfo synthesized_schedule_info() {
  ScheduleInfo info;
  info.name = "synth";
  // A short search (some 1000 evaluations at p = 4, m = 8), as every program and test that walks the registry
  // generates it; programs that synthesize for real costs pass their own options.
  SynthesisOptions brief;
  brief.max_work = 250'000;
  info.make = [brief] { return std::make_unique<SynthesizedScheduleGenerator>(RankCosts{}, 0, brief); };
  info.default_chunks_per_rank = 2;
  info.summary = "synthesized for the costs (default F = I = W = 1, B = 2) within 1F1B's memory";
  return info;
}

}  // namespace detail
}  // namespace twobp
