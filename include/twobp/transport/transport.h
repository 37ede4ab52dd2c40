#pragma once
// Point-to-point tensor transport between pipeline ranks. One interface, several implementations:
// LocalTransport (ranks are threads of one process), MpiTransport (CPU tensors between processes) and
// NcclTransport (CUDA tensors, one rank per GPU). The executor never knows which one it talks to.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "twobp/transport/pairing.h"

namespace twobp {

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::milliseconds;

/// Handle of an asynchronous send or receive.
///
/// Contract: wait() blocks until the operation completed (a received tensor is then valid for use on the
/// current CUDA stream, for GPU transports) or the timeout elapsed, in which case it throws TimeoutError naming
/// the peer and the operation's label. A transport failure or an abort raised by another rank throws
/// TransportError. wait() may be called at most once; destroying an unfinished Work of a send is allowed only
/// after the transport was aborted.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait(Duration timeout) = 0;
  /// Non-blocking probe; throws like wait() if the operation failed.
  virtual bool is_completed() = 0;
};

/// Describes one point-to-point operation. `tag` must be unique among the operations in flight between the
/// same pair of ranks; `label` ("SEND_F stage 1 micro-batch 3") is used in every error about the operation.
/// `channel` selects the ordered stream of messages an in-order transport (Pairing::kInOrderPerChannel) pairs
/// within; by-tag transports ignore it. The Pipeline sets it from message_channel(). `timeout` bounds any wait
/// inside isend/irecv themselves (an in-order transport may have to wait until the previous operation on the
/// channel was handed to the device); it never waits for the peer there.
struct P2POptions {
  int peer = 0;
  std::int64_t tag = 0;
  std::string label;
  int channel = 0;
  Duration timeout = std::chrono::minutes(5);
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Device tensors live on (CPU for Local/MPI, the rank's GPU for NCCL).
  virtual c10::Device device() const = 0;
  virtual std::string name() const = 0;
  /// How this transport pairs a receive with a send (see Pairing). A Pipeline refuses, before its first step, a
  /// schedule that this rule cannot pair (validate(schedule, pairing())).
  virtual Pairing pairing() const = 0;

  /// Sends `tensor` (contiguous) to options.peer. The tensor must not be modified until wait() returned.
  virtual std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) = 0;

  /// Receives into `buffer`, which must be contiguous and have exactly the shape and dtype of what the peer
  /// sends; a mismatch is reported by wait() as UsageError naming both ranks (where the transport can tell).
  virtual std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) = 0;

  /// Sums `tensor` element-wise across all ranks in place (small tensors: losses, gradient norms).
  /// Every rank must call it in the same order. Blocks at most `timeout`.
  virtual void all_reduce_sum(at::Tensor& tensor, Duration timeout) = 0;

  /// Blocks until every rank reached the barrier, or throws TimeoutError.
  virtual void barrier(Duration timeout) = 0;

  /// Tells every peer that this rank failed with `reason`, so their pending and future waits throw
  /// TransportError naming this rank instead of waiting for their timeout. Under MPI this aborts the job.
  virtual void abort(const std::string& reason) = 0;
};

}  // namespace twobp
