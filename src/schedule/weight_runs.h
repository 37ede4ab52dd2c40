#pragma once
// Private: the one rule for runs of W's, shared by the V generators and the PyTorch CSV reader.

#include <utility>
#include <vector>

#include "twobp/schedule/action.h"

namespace twobp::detail {

/// Appends `a` to a rank's compute order, except that a W right after a W of the same stage joins it: W's of one
/// stage back to back are one batched W over their micro-batches (the same gradients in fewer, larger GEMMs; and
/// what PyTorch's CSV, one W per cell, is read back as).
inline void append_joining_weight_runs(std::vector<Action>& order, Action a) {
  Action* prev = order.empty() ? nullptr : &order.back();
  if (a.type == ActionType::kBackwardWeight && prev != nullptr && prev->type == ActionType::kBackwardWeight &&
      prev->stage == a.stage) {
    prev->micro_batches.insert(prev->micro_batches.end(), a.micro_batches.begin(), a.micro_batches.end());
  } else {
    order.push_back(std::move(a));
  }
}

}  // namespace twobp::detail
