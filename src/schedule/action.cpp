#include "twobp/schedule/action.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace twobp {

const char* to_string(ActionType type) {
  switch (type) {
    case ActionType::kForward:
      return "F";
    case ActionType::kBackwardInput:
      return "I";
    case ActionType::kBackwardWeight:
      return "W";
    case ActionType::kBackward:
      return "B";
    case ActionType::kSendForward:
      return "SEND_F";
    case ActionType::kRecvForward:
      return "RECV_F";
    case ActionType::kSendBackward:
      return "SEND_B";
    case ActionType::kRecvBackward:
      return "RECV_B";
  }
  return "?";
}

std::string describe(const Action& action) {
  return fmt::format("{} stage {} micro-batch{} {}{}", to_string(action.type), action.stage,
                     action.micro_batches.size() > 1 ? "es" : "", fmt::join(action.micro_batches, ","),
                     action.overlapped_with_next ? " (overlapped with the next action)" : "");
}

}  // namespace twobp
