#pragma once
// A schedule that is valid for by-tag transports but not for in-order ones (NCCL): 2 ranks, 4 stages placed
// 0,1,0,1, 2 micro-batches, fused backward. Rank 0 runs both micro-batches of stage 0 before stage 2 (breadth
// first), rank 1 runs stage 1 and stage 3 of micro-batch 0 before micro-batch 1 (depth first). On the
// activation channel 0 -> 1 rank 0 therefore sends (s0 mb0, s0 mb1, s2 mb0, s2 mb1) while rank 1 receives
// (s1 mb0, s3 mb0, s1 mb1, s3 mb1): an in-order transport would hand stage 0's micro-batch 1 to stage 3.

#include "twobp/schedule/schedule.h"

namespace twobp::testing {

inline Schedule breadth_first_vs_depth_first() {
  Schedule sc;
  sc.name = "breadth-vs-depth";
  sc.num_ranks = 2;
  sc.num_stages = 4;
  sc.num_micro_batches = 2;
  sc.backward = BackwardMode::kStandard;
  sc.stage_to_rank = {0, 1, 0, 1};
  auto a = [](ActionType t, int s, int mb) { return Action{t, s, {mb}}; };
  constexpr auto F = ActionType::kForward;
  constexpr auto B = ActionType::kBackward;
  sc.actions = {{a(F, 0, 0), a(F, 0, 1), a(F, 2, 0), a(F, 2, 1), a(B, 2, 0), a(B, 2, 1), a(B, 0, 0), a(B, 0, 1)},
                {a(F, 1, 0), a(F, 3, 0), a(F, 1, 1), a(F, 3, 1), a(B, 3, 0), a(B, 3, 1), a(B, 1, 0), a(B, 1, 1)}};
  return add_communication(sc);
}

}  // namespace twobp::testing
