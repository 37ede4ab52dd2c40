// validate(): the checks every schedule must pass before an executor may run it.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "schedule/dry_run.h"
#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/messages.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"
#include "util/check.h"

namespace twobp {
namespace {

struct Where {
  int rank = -1;
  std::size_t index = 0;
};

class Validator {
 public:
  explicit Validator(const Schedule& sc)
      : sc_(sc), S_(sc.num_stages), M_(sc.num_micro_batches), n_(static_cast<std::size_t>(S_) * M_) {}

  void run(Pairing pairing) {
    detail::check_plausible_size(sc_);
    check_kinds_and_ranks();
    check_overlapped_pairs();
    check_counts();
    check_matching();
    check_local_order();
    if (pairing == Pairing::kInOrderPerChannel) check_in_order_pairing();
    check_deadlock();
  }

 private:
  std::size_t key(int s, int mb) const { return static_cast<std::size_t>(s) * M_ + mb; }
  int owner(int s) const { return sc_.stage_to_rank[s]; }
  const Action& at(Where w) const { return sc_.actions[w.rank][w.index]; }

  [[noreturn]] void fail(Where w, const std::string& problem) const {
    const Action& a = at(w);
    detail::raise<ScheduleError>("invalid schedule '{}': rank {}, action #{} ({}): {}\n{}", sc_.name, w.rank, w.index,
                                 describe(a), problem, render_grid(sc_, &a, w.rank));
  }
  [[noreturn]] void fail_missing(const std::string& problem) const {
    detail::raise<ScheduleError>("invalid schedule '{}': {}\n{}", sc_.name, problem, render_grid(sc_));
  }

  template <typename F>
  void for_each(F&& f) const {
    for (int r = 0; r < sc_.num_ranks; ++r) {
      for (std::size_t i = 0; i < sc_.actions[r].size(); ++i) f(Where{r, i}, sc_.actions[r][i]);
    }
  }

  // Right backward mode, right rank, and communication only where a stage boundary crosses ranks. A split
  // schedule may still fuse the backward of some micro-batches (DualPipeV's B's beside its I/W's): each (stage,
  // micro-batch) is then backpropagated by either B or I and W (check_each_once).
  void check_kinds_and_ranks() const {
    const bool split = sc_.backward == BackwardMode::kSplit;
    for_each([&](Where w, const Action& a) {
      if (!split && (a.type == ActionType::kBackwardInput || a.type == ActionType::kBackwardWeight)) {
        fail(w, fmt::format("a standard-backward schedule must use B, found {}", to_string(a.type)));
      }
      if (owner(a.stage) != w.rank) {
        fail(w, fmt::format("stage {} is owned by rank {}, so the action belongs on rank {}, not rank {}", a.stage,
                            owner(a.stage), owner(a.stage), w.rank));
      }
      if (!is_compute(a.type)) {
        const int peer = peer_stage(a);
        if (owner(peer) == w.rank) {
          fail(w, fmt::format("stages {} and {} are both on rank {}: expected no communication (the tensors are "
                              "handed over locally)",
                              a.stage, peer, w.rank));
        }
      }
    });
  }

  // An overlapped pair (Action::overlapped_with_next) is an F whose next compute action on the rank is the B or I
  // of another stage (the parts share no stage state when they run at once), with nothing between them but the
  // F's sends and the B's receives -- what for_overlapped_pairs() moves around the pair (validate() checks that
  // layout too: both parts' inputs before the F, their outputs after the B).
  void check_overlapped_pairs() const {
    for_each([&](Where w, const Action& a) {
      if (!a.overlapped_with_next) return;
      if (a.type != ActionType::kForward) fail(w, "only an F may open an overlapped pair (overlapped_with_next)");
      const auto& list = sc_.actions[w.rank];
      std::size_t j = w.index + 1;
      while (j < list.size() && !is_compute(list[j].type)) ++j;
      if (j == list.size()) fail(w, "an overlapped pair needs a second part (a B or I) after its F; none follows");
      const Action& b = list[j];
      if (b.type != ActionType::kBackward && b.type != ActionType::kBackwardInput) {
        fail(w, fmt::format("an overlapped pair is an F and the B or I that follows it, found {}", describe(b)));
      }
      if (b.stage == a.stage) {
        fail(w, fmt::format("the two parts of an overlapped pair must be on different stages (they may run at the "
                            "same time), but {} is on stage {} too",
                            describe(b), a.stage));
      }
      for (std::size_t k = w.index + 1; k < j; ++k) {
        const Action& c = list[k];
        const bool f_send =
            c.type == ActionType::kSendForward && c.stage == a.stage && c.micro_batches == a.micro_batches;
        const bool b_recv =
            c.type == ActionType::kRecvBackward && c.stage == b.stage && c.micro_batches == b.micro_batches;
        if (!f_send && !b_recv) {
          fail(w, fmt::format("between the parts of an overlapped pair only the F's sends and the B's receives may "
                              "come, found {}",
                              describe(c)));
        }
      }
    });
  }

  // Exactly one F per (stage, mb); exactly one B, or exactly one I and a W covering it exactly once; at most
  // one of each communication action.
  void check_counts() const {
    enum Kind { kF, kBwd, kW, kSendF, kRecvF, kSendB, kRecvB, kKinds };
    std::vector<std::vector<Where>> seen(kKinds, std::vector<Where>(n_));
    auto kind_of = [](ActionType t) {
      switch (t) {
        case ActionType::kForward:
          return kF;
        case ActionType::kBackwardInput:
        case ActionType::kBackward:
          return kBwd;
        case ActionType::kBackwardWeight:
          return kW;
        case ActionType::kSendForward:
          return kSendF;
        case ActionType::kRecvForward:
          return kRecvF;
        case ActionType::kSendBackward:
          return kSendB;
        case ActionType::kRecvBackward:
          return kRecvB;
      }
      return kF;
    };
    for_each([&](Where w, const Action& a) {
      const Kind k = kind_of(a.type);
      for (int mb : a.micro_batches) {
        Where& first = seen[k][key(a.stage, mb)];
        if (first.rank >= 0) {
          fail(w, fmt::format("duplicate: stage {} micro-batch {} already has {} (rank {}, action #{}); expected "
                              "exactly one",
                              a.stage, mb, describe(at(first)), first.rank, first.index));
        }
        first = w;
      }
    });
    const bool split = sc_.backward == BackwardMode::kSplit;
    for (int s = 0; s < S_; ++s) {
      for (int mb = 0; mb < M_; ++mb) {
        if (seen[kF][key(s, mb)].rank < 0) {
          fail_missing(
              fmt::format("missing F for stage {} micro-batch {}: expected exactly one, on rank {}", s, mb, owner(s)));
        }
        if (seen[kBwd][key(s, mb)].rank < 0) {
          fail_missing(fmt::format("missing {} for stage {} micro-batch {}: expected exactly one, on rank {}",
                                   split ? "I" : "B", s, mb, owner(s)));
        }
        const Where backward = seen[kBwd][key(s, mb)];
        const bool fused = backward.rank >= 0 && at(backward).type == ActionType::kBackward;
        const Where weight = seen[kW][key(s, mb)];
        if (split && !fused && weight.rank < 0) {
          fail_missing(
              fmt::format("missing W for stage {} micro-batch {}: expected exactly one W covering it, on "
                          "rank {}",
                          s, mb, owner(s)));
        }
        if (fused && weight.rank >= 0) {
          fail(weight, fmt::format("W of stage {} micro-batch {}, whose backward is the fused B of action #{}: a "
                                   "micro-batch is backpropagated by B, or by I and W",
                                   s, mb, backward.index));
        }
      }
    }
  }

  // Every SEND has its RECV on the neighbour and vice versa.
  void check_matching() const {
    std::vector<bool> send_f(n_), recv_f(n_), send_b(n_), recv_b(n_);
    for_each([&](Where, const Action& a) {
      const std::size_t k = key(a.stage, a.micro_batches.front());
      if (a.type == ActionType::kSendForward) send_f[k] = true;
      if (a.type == ActionType::kRecvForward) recv_f[k] = true;
      if (a.type == ActionType::kSendBackward) send_b[k] = true;
      if (a.type == ActionType::kRecvBackward) recv_b[k] = true;
    });
    for_each([&](Where w, const Action& a) {
      const int mb = a.micro_batches.front();
      const int peer = peer_stage(a);
      const char* expected = nullptr;
      bool found = true;
      switch (a.type) {
        case ActionType::kSendForward:
          found = recv_f[key(peer, mb)];
          expected = "RECV_F";
          break;
        case ActionType::kRecvForward:
          found = send_f[key(peer, mb)];
          expected = "SEND_F";
          break;
        case ActionType::kSendBackward:
          found = recv_b[key(peer, mb)];
          expected = "RECV_B";
          break;
        case ActionType::kRecvBackward:
          found = send_b[key(peer, mb)];
          expected = "SEND_B";
          break;
        default:
          break;
      }
      if (!found) {
        fail(w, fmt::format(
                    "no matching {} stage {} micro-batch {} on rank {}: expected every SEND to have exactly one RECV "
                    "and vice versa",
                    expected, peer, mb, owner(peer)));
      }
    });
  }

  // Orderings each rank can check on its own: every item an action needs (dependencies(), the one table of action
  // meaning) is made available on its rank by an earlier action. Micro-batches may go in any order (PyTorch's
  // looped BFS runs its backward from the last one): messages are matched by tag, and on in-order transports
  // check_in_order_pairing() requires both ends of a channel to agree.
  void check_local_order() const {
    constexpr std::size_t kItems = 4;
    for (int r = 0; r < sc_.num_ranks; ++r) {
      std::vector<bool> available(kItems * n_);
      auto slot = [&](const ItemRef& it) { return static_cast<std::size_t>(it.item) * n_ + key(it.stage, it.micro_batch); };
      for (std::size_t i = 0; i < sc_.actions[r].size(); ++i) {
        const Where w{r, i};
        const Action& a = sc_.actions[r][i];
        const ActionDependencies deps = dependencies(a, S_);
        for (const ItemRef& need : deps.needs) {
          if (available[slot(need)]) continue;
          const Action producer = local_producer(need, r, sc_);
          fail(w, fmt::format("{} runs before {}, which makes {} available on rank {}: expected {} earlier",
                              to_string(a.type), describe(producer), describe(need), r, describe(producer)));
        }
        for (const ItemRef& made : deps.produces) available[slot(made)] = true;
      }
    }
  }

  // For transports that pair in posting order per channel (NCCL): the Pipeline posts sends and receives in the
  // order of its action list, so on every channel (src, dst, message_channel) the sequence of SENDs on src must
  // name the same messages, in the same order, as the sequence of RECVs on dst. Otherwise such a transport hands
  // the n-th message to the n-th receive anyway: a silent swap when shapes agree.
  void check_in_order_pairing() const {
    struct Posted {
      std::vector<Where> sends, recvs;
    };
    std::map<std::tuple<int, int, int>, Posted> channels;  // (src, dst, channel)
    for_each([&](Where w, const Action& a) {
      if (is_compute(a.type)) return;
      const int peer = owner(peer_stage(a));
      const int channel = message_channel(a);
      const bool send = is_send(a.type);
      if (send) {
        channels[{w.rank, peer, channel}].sends.push_back(w);
      } else {
        channels[{peer, w.rank, channel}].recvs.push_back(w);
      }
    });
    for (const auto& [key, posted] : channels) {
      const auto [src, dst, channel] = key;
      // check_matching() guarantees equal counts; compare position by position.
      for (std::size_t n = 0; n < posted.sends.size() && n < posted.recvs.size(); ++n) {
        const Action& send = at(posted.sends[n]);
        const Action& recv = at(posted.recvs[n]);
        if (message_tag(sc_, send) != message_tag(sc_, recv)) {
          fail(posted.recvs[n],
               fmt::format("in-order pairing: on channel {} ({}) from rank {} to rank {}, receive #{} is this {} but "
                           "send #{} on rank {} is {} (action #{}); a transport that pairs in posting order per "
                           "channel (NCCL) would deliver that tensor here: expected both ranks to post the channel's "
                           "messages in the same order",
                           channel, channel == 0 ? "activations" : "gradients", src, dst, n, describe(recv), n, src,
                           describe(send), posted.sends[n].index));
        }
      }
    }
  }

  // Sends are buffered, a RECV completes once its SEND ran: if the dry run stops, the ranks wait on each other.
  void check_deadlock() const {
    const detail::DryRun run = detail::dry_run(sc_, CostModel::uniform(S_, 1.0, 1.0, 1.0, 0.0));
    if (run.complete) return;
    std::string waits;
    Where first;
    for (int r = 0; r < sc_.num_ranks; ++r) {
      if (run.next[r] >= sc_.actions[r].size()) continue;
      const Where w{r, run.next[r]};
      if (first.rank < 0) first = w;
      const Action& a = at(w);
      std::string waiting_for;
      if (!is_compute(a.type)) {
        const int peer = peer_stage(a);
        const ActionType send =
            a.type == ActionType::kRecvForward ? ActionType::kSendForward : ActionType::kSendBackward;
        waiting_for = fmt::format(" for {} stage {} micro-batch {} from rank {}", to_string(send), peer,
                                  a.micro_batches.front(), owner(peer));
      }
      waits += fmt::format("; rank {} waits at action #{} ({}){}", r, w.index, describe(a), waiting_for);
    }
    fail(first, fmt::format("deadlock: no rank can make progress{}", waits));
  }

  const Schedule& sc_;
  const int S_;
  const int M_;
  const std::size_t n_;
};

}  // namespace

void validate(const Schedule& schedule, Pairing pairing) {
  detail::check_structure(schedule);
  Validator(schedule).run(pairing);
  const bool pairs = std::any_of(schedule.actions.begin(), schedule.actions.end(), [](const auto& list) {
    return std::any_of(list.begin(), list.end(), [](const Action& a) { return a.overlapped_with_next; });
  });
  if (!pairs) return;
  // The same schedule as a runtime that overlaps the pairs runs it (ExecutorOptions::overlap_forward_backward).
  try {
    Validator(for_overlapped_pairs(schedule)).run(pairing);
  } catch (const ScheduleError& e) {
    detail::raise<ScheduleError>("schedule '{}' is valid run in order, but not with its overlapped pairs run at once "
                                 "(for_overlapped_pairs: both parts' receives before the F, sends after the B): {}",
                                 schedule.name, e.what());
  }
}

}  // namespace twobp
