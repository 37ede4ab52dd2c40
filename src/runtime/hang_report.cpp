#include "twobp/runtime/hang_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
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
      return fmt::format("waiting {:.1f} s for {}{}{}", s.seconds, what,
                         s.peer >= 0 ? fmt::format(" from rank {}", s.peer) : "", run);
    }
    case RankStatus::State::kComputing: return fmt::format("computing {} for {:.1f} s{}", s.action, s.seconds, run);
    case RankStatus::State::kFailed: return fmt::format("failed{}: {}", run, s.detail);
    case RankStatus::State::kOutsideStep:
      return s.run >= 0 ? fmt::format("outside a step for {:.1f} s, after run {}", s.seconds, s.run)
                        : "has not started a step";
  }
  return "";
}

// Why `culprit` stops the ranks that wait on it, given that `waiter` (in run `run`) waits on it.
std::string why(int culprit, const std::optional<RankStatus>& s, std::int64_t run) {
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
  return nlohmann::json{{"state", state_name(s.state)}, {"action", s.action}, {"peer", s.peer},
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
    s.run = j.at("run").get<std::int64_t>();
    s.seconds = j.at("seconds").get<double>();
    s.detail = j.at("detail").get<std::string>();
    return s;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

std::string hang_report(const std::vector<std::optional<RankStatus>>& statuses, int reporter) {
  const int world = static_cast<int>(statuses.size());
  auto waits_on = [&](int r) -> int {
    const auto& s = statuses[static_cast<std::size_t>(r)];
    return s && s->state == RankStatus::State::kWaiting && s->peer >= 0 && s->peer < world ? s->peer : -1;
  };
  // The run the stalled ranks are in: the latest any waiting rank is in.
  std::int64_t run = -1;
  for (const auto& s : statuses) {
    if (s && s->state == RankStatus::State::kWaiting) run = std::max(run, s->run);
  }

  // Every chain of waits ends at a rank that waits on no peer, or closes into a cycle.
  std::set<int> ends;
  std::set<std::vector<int>> cycles;
  for (int start = 0; start < world; ++start) {
    if (waits_on(start) < 0) continue;
    std::vector<int> path{start};
    int r = start;
    while (waits_on(r) >= 0) {
      r = waits_on(r);
      const auto seen = std::find(path.begin(), path.end(), r);
      if (seen != path.end()) {
        std::vector<int> cycle(seen, path.end());
        std::rotate(cycle.begin(), std::min_element(cycle.begin(), cycle.end()), cycle.end());
        cycles.insert(cycle);
        r = -1;
        break;
      }
      path.push_back(r);
    }
    if (r >= 0) ends.insert(r);
  }

  std::string verdict;
  for (int r : ends) verdict += (verdict.empty() ? "" : "; ") + why(r, statuses[static_cast<std::size_t>(r)], run);
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
