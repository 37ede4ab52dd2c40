#pragma once
// The wire protocol between the ranks of a pipeline: for each SEND/RECV of a schedule, the peer, the messages
// (an optional shape header, then one message per tensor), their tags and their channels. Both ends compute the
// same values from the schedule alone, so no negotiation is needed. The runtime writes the rest of the protocol:
// the shape header's layout (src/runtime/boundary.h), when receives are posted (ExecutorOptions::prefetch_receives:
// this many RECV actions ahead, in action-list order) and that the tags of run n are offset by n *
// message_tag_span (ExecutorOptions::run_counter).

#include <cstdint>

#include "twobp/schedule/schedule.h"
#include "twobp/transport/pairing.h"

namespace twobp {

/// For a communication action: the stage at the other end of the link (stage + 1 for SEND_F and RECV_B, stage - 1
/// for RECV_F and SEND_B), which may not exist (-1, or num_stages); the action's own stage for compute actions.
int peer_stage(const Action& action);

/// For a communication action of `schedule`: the rank at the other end of the link (the owner of stage + 1 for
/// SEND_F and RECV_B, of stage - 1 for RECV_F and SEND_B). Throws ScheduleError for compute actions or when the
/// neighbouring stage does not exist.
int peer_rank(const Schedule& schedule, const Action& action);

/// The messages of one SEND/RECV: the tensors of a boundary (NamedTensors) travel as one message each, after a
/// shape header when the sender announces shapes (no activation specs). At most kMaxTensorsPerMessage tensors.
constexpr int kMaxTensorsPerMessage = 15;
/// Which message of a SEND/RECV: the shape header, or the k-th tensor (MessagePart{k}).
struct MessagePart {
  static MessagePart header() { return MessagePart{-1}; }
  bool is_header() const { return tensor < 0; }
  int tensor = 0;  ///< index of the tensor among those the SEND carries; -1 for the header
};

/// For a communication action: a tag, identical for a SEND and its matching RECV, that is unique per (stage
/// boundary, micro-batch, direction, part): ((mb * num_stages + boundary) * 2 + dir) * (kMaxTensorsPerMessage + 1)
/// + part.tensor + 1, where boundary is the lower stage of the link, dir is 0 for activations (SEND_F/RECV_F) and 1
/// for gradients (SEND_B/RECV_B).
std::int64_t message_tag(const Schedule& schedule, const Action& action, MessagePart part = {});

/// Every tag message_tag() gives for `schedule` lies in [0, span): num_micro_batches * num_stages * 2 *
/// (kMaxTensorsPerMessage + 1). The executor tags run n's messages message_tag + n * span, so that a message of one
/// run (a step, an evaluation) never pairs with a receive of another -- a duplicated or stale message is then left
/// unmatched (by-tag pairing) or refused naming both tags (in-order pairing, MPI's header check), never taken for
/// the next step's.
std::int64_t message_tag_span(const Schedule& schedule);

/// Channels of a schedule's messages: activations (SEND_F/RECV_F) travel on channel 0, gradients (SEND_B/RECV_B)
/// on channel 1, so a channel -- (source rank, destination rank, channel) -- carries one kind of tensor in one
/// direction; shape headers travel on channels 2 and 3 alike, so that a receiver may post the next headers before
/// it knows (and posts) the tensors of the current message. In-order transports (Pairing::kInOrderPerChannel) pair
/// messages per channel; this split is what makes every built-in schedule, zb-v included, pair correctly on them
/// (validate() checks the tensor channels; headers follow the same order on theirs).
constexpr int kNumMessageChannels = 4;

/// For a communication action: its channel in [0, kNumMessageChannels), identical for a SEND and its matching RECV.
/// The one place the action -> channel mapping is written: validate(), the Executor (P2POptions::channel) and
/// through it every transport read it here. Throws ScheduleError for compute actions.
int message_channel(const Action& action, MessagePart part = {});
static_assert(kNumMessageChannels <= kDefaultChannelsPerLink,
              "a transport's default channels must carry every message kind of the pipeline protocol");

}  // namespace twobp
