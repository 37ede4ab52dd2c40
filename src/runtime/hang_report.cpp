#include "twobp/runtime/hang_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

namespace twobp {
namespace {

const char* state_name(RankStatus::State s) {
  switch (s) {
    case RankStatus::State::kOutsideStep: return "outside";
    case RankStatus::State::kComputing: return "computing";
    case RankStatus::State::kWaiting: return "waiting";
    case RankStatus::State::kFailed: return "failed";
  }
  return "outside";
}

std::optional<RankStatus::State> state_of(const std::string& name) {
  for (auto s : {RankStatus::State::kOutsideStep, RankStatus::State::kComputing, RankStatus::State::kWaiting,
                 RankStatus::State::kFailed}) {
    if (name == state_name(s)) return s;
  }
  return std::nullopt;
}

// "waiting 1.6 s for RECV_B stage 0 micro-batch 1 from rank 1"
std::string describe_status(const RankStatus& s) {
  const std::string run = s.run >= 0 ? fmt::format(" (run {})", s.run) : "";
  switch (s.state) {
    case RankStatus::State::kWaiting: {
      const std::string what = !s.action.empty() ? s.action : s.detail.empty() ? "a message" : s.detail;
      const std::string from = s.peer >= 0        ? fmt::format(" from rank {}", s.peer)
                               : !s.peers.empty() ? fmt::format(" with ranks {}", fmt::join(s.peers, ", "))
                                                  : "";
      return fmt::format("waiting {:.1f} s for {}{}{}", s.seconds, what, from, run);
    }
    case RankStatus::State::kComputing: return fmt::format("computing {} for {:.1f} s{}", s.action, s.seconds, run);
    case RankStatus::State::kFailed: return fmt::format("failed{}: {}", run, s.detail);
    case RankStatus::State::kOutsideStep:
      return s.run >= 0 ? fmt::format("outside a step for {:.1f} s, after run {}", s.seconds, s.run)
                        : "has not started a step";
  }
  return "";
}

// Why `culprit` stops the ranks that wait on it, given that they are in run `run`; `collective`: the collective
// some of them wait for it in ("": they wait for its messages).
std::string why(int culprit, const std::optional<RankStatus>& s, std::int64_t run, const std::string& collective) {
  if (!s) return fmt::format("rank {} did not answer: it is dead, or busy outside twobp's waits", culprit);
  switch (s->state) {
    case RankStatus::State::kComputing:
      return fmt::format("rank {} is computing {} for {:.1f} s and waits for no message: a slow or stuck "
                         "computation (or the timeout is too short for it)",
                         culprit, s->action, s->seconds);
    case RankStatus::State::kFailed: return fmt::format("rank {} failed: {}", culprit, s->detail);
    case RankStatus::State::kWaiting:
      return fmt::format("rank {} is waiting for {} and for no other rank", culprit,
                         s->detail.empty() ? s->action : s->detail);
    case RankStatus::State::kOutsideStep:
      if (s->run >= run && !collective.empty()) {
        return fmt::format("rank {} finished its part of run {} {:.1f} s ago and has not joined {}: its caller has "
                           "not reached it yet, or is busy",
                           culprit, run, s->seconds, collective);
      }
      if (s->run < run) {
        return fmt::format("rank {} has not started run {} ({}): its caller has not called step() yet, or is "
                           "busy between steps",
                           culprit, run,
                           s->run < 0 ? std::string("it has run no step yet")
                                      : fmt::format("it ended run {} {:.1f} s ago", s->run, s->seconds));
      }
      return fmt::format("rank {} finished its part of run {}: a message it sent was lost, or was taken by "
                         "another receive",
                         culprit, run);
  }
  return "";
}

}  // namespace

std::string encode(const RankStatus& s) {
  return nlohmann::json{{"state", state_name(s.state)}, {"action", s.action},   {"peer", s.peer}, {"peers", s.peers},
                        {"run", s.run},                 {"seconds", s.seconds}, {"detail", s.detail}}
      .dump();
}

std::optional<RankStatus> decode_rank_status(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  try {
    RankStatus s;
    const auto state = state_of(j.at("state").get<std::string>());
    if (!state) return std::nullopt;
    s.state = *state;
    s.action = j.at("action").get<std::string>();
    s.peer = j.at("peer").get<int>();
    s.peers = j.value("peers", std::vector<int>{});  // absent: no collective
    s.run = j.at("run").get<std::int64_t>();
    s.seconds = j.at("seconds").get<double>();
    s.detail = j.at("detail").get<std::string>();
    return s;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

namespace {

// The wait-for edges of rank r: the rank whose message it waits for, or the ranks of its collective that have not
// joined it (a rank waiting in the same collective of the same run has).
std::vector<int> waits_on(const std::vector<std::optional<RankStatus>>& statuses, int r) {
  const int world = static_cast<int>(statuses.size());
  const auto& s = statuses[static_cast<std::size_t>(r)];
  if (!s || s->state != RankStatus::State::kWaiting) return {};
  if (s->peer >= 0) return s->peer < world ? std::vector<int>{s->peer} : std::vector<int>{};
  std::vector<int> out;
  for (int q : s->peers) {
    if (q < 0 || q >= world || q == r) continue;
    const auto& t = statuses[static_cast<std::size_t>(q)];
    const bool joined = t && t->state == RankStatus::State::kWaiting && t->peer < 0 && !t->peers.empty() &&
                        t->detail == s->detail && t->run == s->run;
    if (!joined) out.push_back(q);
  }
  return out;
}

// Depth-first over the edges from `r` (`path`: the ranks on the way, in order): every rank reached that waits on
// no one goes to `ends`, every edge back onto the path closes a cycle (rotated to start at its lowest rank).
void follow(const std::vector<std::vector<int>>& edges, int r, std::vector<int>& path, std::set<int>& done,
            std::set<int>& ends, std::set<std::vector<int>>& cycles) {
  if (edges[static_cast<std::size_t>(r)].empty()) {
    ends.insert(r);
    return;
  }
  path.push_back(r);
  for (int q : edges[static_cast<std::size_t>(r)]) {
    const auto seen = std::find(path.begin(), path.end(), q);
    if (seen != path.end()) {
      std::vector<int> cycle(seen, path.end());
      std::rotate(cycle.begin(), std::min_element(cycle.begin(), cycle.end()), cycle.end());
      cycles.insert(cycle);
    } else if (!done.count(q)) {
      follow(edges, q, path, done, ends, cycles);
    }
  }
  path.pop_back();
  done.insert(r);
}

}  // namespace

std::string hang_report(const std::vector<std::optional<RankStatus>>& statuses, int reporter) {
  const int world = static_cast<int>(statuses.size());
  std::vector<std::vector<int>> edges;
  for (int r = 0; r < world; ++r) edges.push_back(waits_on(statuses, r));
  // The run the stalled ranks are in: the latest any waiting rank is in.
  std::int64_t run = -1;
  for (const auto& s : statuses) {
    if (s && s->state == RankStatus::State::kWaiting) run = std::max(run, s->run);
  }

  // Every chain of waits ends at a rank that waits on no peer, or closes into a cycle.
  std::set<int> ends, done;
  std::set<std::vector<int>> cycles;
  for (int start = 0; start < world; ++start) {
    if (edges[static_cast<std::size_t>(start)].empty() || done.count(start)) continue;
    std::vector<int> path;
    follow(edges, start, path, done, ends, cycles);
  }

  // The collective each end is awaited in, if any (a rank outside the step has then not joined it yet).
  std::map<int, std::string> awaited_in;
  for (int r = 0; r < world; ++r) {
    const auto& s = statuses[static_cast<std::size_t>(r)];
    if (!s || s->peer >= 0 || s->peers.empty()) continue;
    for (int q : edges[static_cast<std::size_t>(r)]) awaited_in[q] = s->detail;
  }
  std::string verdict;
  for (int r : ends) {
    verdict += (verdict.empty() ? "" : "; ") + why(r, statuses[static_cast<std::size_t>(r)], run, awaited_in[r]);
  }
  for (const auto& c : cycles) {
    std::vector<int> closed = c;
    closed.push_back(c.front());
    verdict += (verdict.empty() ? "" : "; ") +
               fmt::format("ranks {} wait on each other in a cycle: a message between them was lost, or their "
                           "orders disagree (a deadlock)",
                           fmt::join(closed, " -> "));
  }
  if (verdict.empty()) verdict = "no rank waits for another: every wait ended or none is known";

  std::string out = fmt::format("hang report (by rank {}, {} ranks): {}", reporter, world, verdict);
  for (int r = 0; r < world; ++r) {
    const auto& s = statuses[static_cast<std::size_t>(r)];
    out += fmt::format("\n  rank {}: {}", r, s ? describe_status(*s) : "did not answer");
  }
  return out;
}

}  // namespace twobp
