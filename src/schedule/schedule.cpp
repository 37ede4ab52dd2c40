// Schedule basics: placement queries, communication insertion, tags and the cost model.

#include "twobp/schedule/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

#include "util/check.h"

namespace twobp {

namespace {

// Every spelling of a mode, the one to_string() writes first.
struct ModeSpelling {
  std::string_view text;
  BackwardMode mode;
};
constexpr ModeSpelling kModeSpellings[] = {
    {"standard", BackwardMode::kStandard}, {"2bp", BackwardMode::kSplit},
    {"fused", BackwardMode::kStandard},    {"fused-backward", BackwardMode::kStandard},
    {"split", BackwardMode::kSplit},       {"2BP", BackwardMode::kSplit},
};

}  // namespace

const char* to_string(BackwardMode mode) {
  for (const ModeSpelling& s : kModeSpellings) {
    if (s.mode == mode) return s.text.data();  // the table's literals end in '\0'
  }
  return "unknown";
}

BackwardMode parse_backward_mode(std::string_view text) {
  for (const ModeSpelling& s : kModeSpellings) {
    if (s.text == text) return s.mode;
  }
  throw UsageError(fmt::format("unknown backward mode '{}': expected standard or 2bp (aliases: fused, "
                               "fused-backward; split, 2BP)",
                               text));
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> stages;
  for (int s = 0; s < static_cast<int>(stage_to_rank.size()); ++s) {
    if (stage_to_rank[s] == rank) stages.push_back(s);
  }
  return stages;
}

Schedule forward_only(Schedule schedule) {
  for (auto& list : schedule.actions) {
    list.erase(std::remove_if(list.begin(), list.end(),
                              [](const Action& a) {
                                return a.type != ActionType::kForward && a.type != ActionType::kSendForward &&
                                       a.type != ActionType::kRecvForward;
                              }),
               list.end());
    for (Action& a : list) a.overlapped_with_next = false;  // its B is gone
  }
  schedule.name += " (forward only)";
  return schedule;
}

Schedule one_micro_batch_per_weight(Schedule schedule) {
  bool split = false;
  for (auto& list : schedule.actions) {
    std::vector<Action> out;
    for (const Action& a : list) {
      if (a.type != ActionType::kBackwardWeight || a.micro_batches.size() < 2) {
        out.push_back(a);
        continue;
      }
      split = true;
      for (int mb : a.micro_batches) {
        Action one = a;
        one.micro_batches = {mb};
        out.push_back(std::move(one));
      }
    }
    list = std::move(out);
  }
  if (split) schedule.name += " (one micro-batch per W)";
  return schedule;
}

namespace {

// For an overlapped pair opened at `list[i]`: the index of its second part (the next compute action), or npos.
std::size_t partner_of(const std::vector<Action>& list, std::size_t i) {
  for (std::size_t k = i + 1; k < list.size(); ++k) {
    if (is_compute(list[k].type)) return k;
  }
  return std::string::npos;
}

}  // namespace

Schedule for_overlapped_pairs(Schedule schedule) {
  for (auto& list : schedule.actions) {
    std::vector<Action> out;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::size_t j = list[i].overlapped_with_next ? partner_of(list, i) : std::string::npos;
      if (j == std::string::npos) {
        out.push_back(list[i]);
        continue;
      }
      // Between the parts: the F's sends and the B's receives (validate() allows nothing else there).
      for (std::size_t k = i + 1; k < j; ++k) {
        const ActionType t = list[k].type;
        if (is_receive(t)) out.push_back(list[k]);
      }
      out.push_back(list[i]);
      out.push_back(list[j]);
      for (std::size_t k = i + 1; k < j; ++k) {
        const ActionType t = list[k].type;
        if (is_send(t)) out.push_back(list[k]);
      }
      i = j;
    }
    list = std::move(out);
  }
  return schedule;
}

Schedule add_communication(Schedule schedule) {
  const int num_stages = schedule.num_stages;
  TWOBP_CHECK(static_cast<int>(schedule.stage_to_rank.size()) == num_stages, ScheduleError,
              "add_communication: schedule '{}' has {} stages but a placement of {} entries", schedule.name, num_stages,
              schedule.stage_to_rank.size());
  auto owner = [&](int stage) { return schedule.stage_to_rank[stage]; };
  // Existing communication is dropped and rebuilt, so calling this twice (or on a loaded schedule that already
  // has some) cannot duplicate messages.
  for (int r = 0; r < static_cast<int>(schedule.actions.size()); ++r) {
    std::vector<Action> out;
    for (const Action& a : schedule.actions[r]) {
      if (!is_compute(a.type)) continue;
      TWOBP_CHECK(a.stage >= 0 && a.stage < num_stages && !a.micro_batches.empty(), ScheduleError,
                  "add_communication: rank {}: {} has no valid stage or micro-batch", r, describe(a));
      const int s = a.stage;
      const int mb = a.micro_batches.front();
      // Receives go immediately before their consumer; the executor posts them early on its own. (Inside an
      // overlapped pair too, which then runs as two ordinary actions; for_overlapped_pairs() moves them around
      // the pair for running it at once.)
      if (a.type == ActionType::kForward && s > 0 && owner(s - 1) != owner(s)) {
        out.push_back(Action{ActionType::kRecvForward, s, {mb}});
      }
      const bool is_backward = a.type == ActionType::kBackwardInput || a.type == ActionType::kBackward;
      if (is_backward && s + 1 < num_stages && owner(s + 1) != owner(s)) {
        out.push_back(Action{ActionType::kRecvBackward, s, {mb}});
      }
      out.push_back(a);
      // Sends go right after their producer so the data leaves as early as possible.
      if (a.type == ActionType::kForward && s + 1 < num_stages && owner(s + 1) != owner(s)) {
        out.push_back(Action{ActionType::kSendForward, s, {mb}});
      }
      if (is_backward && s > 0 && owner(s - 1) != owner(s)) {
        out.push_back(Action{ActionType::kSendBackward, s, {mb}});
      }
    }
    schedule.actions[r] = std::move(out);
  }
  return schedule;
}

}  // namespace twobp
