#pragma once
// Helpers shared by the schedule tests.

#include <string>
#include <vector>

#include "twobp/schedule/schedule.h"

namespace twobp::test {

inline Action act(ActionType type, int stage, std::vector<int> mbs) { return Action{type, stage, std::move(mbs)}; }

/// Two ranks, one stage each, with the given per-rank lists; backward mode from the caller.
inline Schedule two_stage(std::vector<std::vector<Action>> actions, int micro_batches = 1,
                          BackwardMode mode = BackwardMode::kStandard) {
  Schedule sc;
  sc.name = "test";
  sc.num_ranks = 2;
  sc.num_stages = 2;
  sc.num_micro_batches = micro_batches;
  sc.backward = mode;
  sc.stage_to_rank = {0, 1};
  sc.actions = std::move(actions);
  return sc;
}

}  // namespace twobp::test
