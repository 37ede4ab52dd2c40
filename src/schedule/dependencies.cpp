#include "twobp/schedule/dependencies.h"

#include <fmt/format.h>

#include "twobp/schedule/schedule.h"

namespace twobp {

const char* to_string(Item item) {
  switch (item) {
    case Item::kActivation: return "activation";
    case Item::kInputGrad: return "input gradient";
    case Item::kSavedGraph: return "saved graph";
    case Item::kPendingWeight: return "pending weight work";
  }
  return "?";
}

std::string describe(const ItemRef& item) {
  return fmt::format("the {} of stage {} micro-batch {}", to_string(item.item), item.stage, item.micro_batch);
}

ActionDependencies dependencies(const Action& a, int num_stages) {
  ActionDependencies d;
  const int s = a.stage, last = num_stages - 1;
  for (int mb : a.micro_batches) {
    switch (a.type) {
      case ActionType::kForward:
        if (s > 0) d.needs.push_back({Item::kActivation, s - 1, mb});
        d.produces.push_back({Item::kSavedGraph, s, mb});
        if (s < last) d.produces.push_back({Item::kActivation, s, mb});
        break;
      case ActionType::kBackwardInput:
      case ActionType::kBackward:
        d.needs.push_back({Item::kSavedGraph, s, mb});
        if (s < last) d.needs.push_back({Item::kInputGrad, s + 1, mb});
        if (a.type == ActionType::kBackwardInput) d.produces.push_back({Item::kPendingWeight, s, mb});
        if (s > 0) d.produces.push_back({Item::kInputGrad, s, mb});
        break;
      case ActionType::kBackwardWeight:
        d.needs.push_back({Item::kPendingWeight, s, mb});
        break;
      case ActionType::kSendForward:
        d.needs.push_back({Item::kActivation, s, mb});
        break;
      case ActionType::kRecvForward:
        d.produces.push_back({Item::kActivation, s - 1, mb});
        break;
      case ActionType::kSendBackward:
        d.needs.push_back({Item::kInputGrad, s, mb});
        break;
      case ActionType::kRecvBackward:
        d.produces.push_back({Item::kInputGrad, s + 1, mb});
        break;
    }
  }
  return d;
}

Action local_producer(const ItemRef& item, int rank, const Schedule& schedule) {
  const bool owned = item.stage >= 0 && item.stage < static_cast<int>(schedule.stage_to_rank.size()) &&
                     schedule.stage_to_rank[item.stage] == rank;
  // The backward the schedule holds for this (stage, micro-batch): split schedules may fuse some (DualPipeV runs B
  // in its steady state and I/W only where they fill a bubble); by the mode when it holds neither.
  ActionType backward = schedule.backward == BackwardMode::kSplit ? ActionType::kBackwardInput : ActionType::kBackward;
  if (owned && item.item == Item::kInputGrad && rank >= 0 && rank < static_cast<int>(schedule.actions.size())) {
    for (const Action& a : schedule.actions[rank]) {
      if ((a.type == ActionType::kBackwardInput || a.type == ActionType::kBackward) && a.stage == item.stage &&
          a.micro_batches.size() == 1 && a.micro_batches[0] == item.micro_batch) {
        backward = a.type;
        break;
      }
    }
  }
  switch (item.item) {
    case Item::kActivation:
      return owned ? Action{ActionType::kForward, item.stage, {item.micro_batch}}
                   : Action{ActionType::kRecvForward, item.stage + 1, {item.micro_batch}};
    case Item::kInputGrad:
      return owned ? Action{backward, item.stage, {item.micro_batch}}
                   : Action{ActionType::kRecvBackward, item.stage - 1, {item.micro_batch}};
    case Item::kSavedGraph:
      return Action{ActionType::kForward, item.stage, {item.micro_batch}};
    case Item::kPendingWeight:
      return Action{ActionType::kBackwardInput, item.stage, {item.micro_batch}};
  }
  return Action{};
}

}  // namespace twobp
