#pragma once
// A transport that wraps another and verifies every point-to-point message end to end: each send is followed by an
// 8-byte checksum of its bytes (a message of its own, on the same channel), and each receive recomputes it and
// refuses a mismatch with TransportError naming the rank, the peer and the message. What it catches: bytes changed
// between the sender's buffer and the receiver's (a faulty link, NIC or driver; FaultInjectingTransport's
// kCorrupt). What it costs, per message and on both sides: one pass over the payload as 32-bit words summed in 64
// bits (a temporary of twice the payload's size for the widening), one extra 8-byte message, and on a GPU receiver
// one host synchronisation to compare. Off by default; the Pipeline turns it on with
// PipelineOptions::verify_messages, which every rank must set alike (the extra messages must be paired).
//
// The sum detects any single flipped bit and any change of one word; it does not detect words swapped with each
// other (not a transit fault). Collectives (all_reduce_sum, broadcast, barrier, split, reduce_scatter_sum,
// all_gather and their async forms) pass through unverified.

#include <memory>
#include <string>

#include "twobp/transport/wrapping.h"

namespace twobp {

/// The checksum of `tensor`'s bytes: a one-element int64 tensor on its device (no host synchronisation).
at::Tensor message_checksum(const at::Tensor& tensor);

class ChecksummingTransport final : public WrappingTransport {
 public:
  explicit ChecksummingTransport(std::shared_ptr<Transport> inner);

  std::string name() const override { return inner_->name() + " (checksummed)"; }
  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override;
};

}  // namespace twobp
