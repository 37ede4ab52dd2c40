// The wire protocol's numbers: peer, tag and channel of each message (twobp/schedule/messages.h).

#include "twobp/schedule/messages.h"

#include <algorithm>

#include "util/check.h"

namespace twobp {

int peer_stage(const Action& action) {
  switch (action.type) {
    case ActionType::kSendForward:
    case ActionType::kRecvBackward:
      return action.stage + 1;
    case ActionType::kRecvForward:
    case ActionType::kSendBackward:
      return action.stage - 1;
    default:
      return action.stage;
  }
}

int peer_rank(const Schedule& schedule, const Action& action) {
  TWOBP_CHECK(!is_compute(action.type), ScheduleError, "peer_rank: {} is a compute action, not a SEND/RECV",
              describe(action));
  const int peer = peer_stage(action);
  TWOBP_CHECK(peer >= 0 && peer < schedule.num_stages && peer < static_cast<int>(schedule.stage_to_rank.size()),
              ScheduleError, "peer_rank: {} has no neighbouring stage {} (schedule has {} stages)", describe(action),
              peer, schedule.num_stages);
  return schedule.stage_to_rank[peer];
}

std::int64_t message_tag(const Schedule& schedule, const Action& action, MessagePart part) {
  TWOBP_CHECK(!is_compute(action.type), ScheduleError, "message_tag: {} is a compute action, not a SEND/RECV",
              describe(action));
  TWOBP_CHECK(action.micro_batches.size() == 1, ScheduleError, "message_tag: {} must name exactly one micro-batch",
              describe(action));
  TWOBP_CHECK(part.tensor < kMaxTensorsPerMessage, UsageError,
              "{}: a stage boundary carries at most {} tensors (tensor {} was asked for)", describe(action),
              kMaxTensorsPerMessage, part.tensor);
  const int peer = peer_stage(action);
  const std::int64_t boundary = std::min(peer, action.stage);
  const std::int64_t dir = message_channel(action);  // 0 activations, 1 gradients
  const std::int64_t mb = action.micro_batches.front();
  return ((mb * schedule.num_stages + boundary) * 2 + dir) * (kMaxTensorsPerMessage + 1) + part.tensor + 1;
}

std::int64_t message_tag_span(const Schedule& schedule) {
  return static_cast<std::int64_t>(schedule.num_micro_batches) * schedule.num_stages * 2 *
         (kMaxTensorsPerMessage + 1);
}

int message_channel(const Action& action, MessagePart part) {
  const int header = part.is_header() ? 2 : 0;
  switch (action.type) {
    case ActionType::kSendForward:
    case ActionType::kRecvForward:
      return 0 + header;
    case ActionType::kSendBackward:
    case ActionType::kRecvBackward:
      return 1 + header;
    default:
      detail::raise<ScheduleError>("message_channel: {} is a compute action, not a SEND/RECV", describe(action));
  }
}

}  // namespace twobp
