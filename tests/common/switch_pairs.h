#pragma once
// Pairs of built-in schedules for Pipeline::switch_schedule tests: every schedule x mode that takes a shape, each
// paired with the next form of the same placement (stage_to_rank), cyclically, so that every form is once the
// schedule switched from and once the one switched to. Forms alone in their placement have no pair.

#include <string>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/schedule/registry.h"

namespace twobp::testing {

struct ScheduleForm {
  std::string name;
  BackwardMode mode = BackwardMode::kSplit;
  Schedule schedule;
  std::string label() const { return name + (mode == BackwardMode::kSplit ? "_2bp" : "_standard"); }
};

inline std::vector<std::pair<ScheduleForm, ScheduleForm>> switch_pairs(int p, int m) {
  std::vector<std::vector<ScheduleForm>> by_placement;
  for (const std::string& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      ScheduleForm f{name, mode, {}};
      try {
        f.schedule = make_schedule(name, default_schedule_options(name, p, m, mode));
      } catch (const ScheduleError&) {
        continue;  // a shape this schedule does not take
      }
      auto group = by_placement.begin();
      while (group != by_placement.end() && group->front().schedule.stage_to_rank != f.schedule.stage_to_rank) ++group;
      if (group == by_placement.end()) {
        by_placement.push_back({f});
      } else {
        group->push_back(f);
      }
    }
  }
  std::vector<std::pair<ScheduleForm, ScheduleForm>> out;
  for (const auto& group : by_placement) {
    if (group.size() < 2) continue;
    for (std::size_t i = 0; i < group.size(); ++i) out.emplace_back(group[i], group[(i + 1) % group.size()]);
  }
  return out;
}

}  // namespace twobp::testing
