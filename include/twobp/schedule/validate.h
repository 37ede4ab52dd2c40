#pragma once
// validate(): whether a schedule can run -- ordering, matching, exactly-once, no deadlock, and pairing on the
// transport it will run on.

#include "twobp/schedule/schedule.h"
#include "twobp/transport/pairing.h"

namespace twobp {

/// Checks ordering (F before I/B, I before W, stage dependencies across ranks), send/recv matching, that every
/// (stage, micro-batch) is computed exactly once, and that a dry run cannot deadlock. With
/// Pairing::kInOrderPerChannel it also checks that on every channel (see message_channel) the sender posts its
/// sends in the order the receiver posts its receives -- the Pipeline posts both in action-list order -- since
/// such a transport would otherwise deliver tensors to the wrong buffers. Throws ScheduleError with the grid and
/// the offending action marked.
void validate(const Schedule& schedule, Pairing pairing = Pairing::kByTag);

}  // namespace twobp
