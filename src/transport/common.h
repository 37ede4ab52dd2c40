#pragma once
// Private helpers shared by the transports: describing tensors in error messages, validating the arguments of
// isend/irecv the same way everywhere, and the poll-with-backoff loop behind every wait(timeout).

#include <ATen/core/Tensor.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>

#include "twobp/transport/transport.h"
#include "util/check.h"

namespace twobp::detail {

/// "[2, 3] float" -- the form every shape/dtype error uses, so that expected and actual read alike.
inline std::string describe_tensor(at::IntArrayRef sizes, c10::ScalarType dtype) {
  std::ostringstream out;
  out << sizes << ' ' << c10::toString(dtype);
  return out.str();
}

inline std::string describe_tensor(const at::Tensor& t) { return describe_tensor(t.sizes(), t.scalar_type()); }

/// "SEND_F stage 1 micro-batch 3", or "tag 7" when the caller gave no label: an error must always say which
/// operation it is about.
inline std::string describe_op(const P2POptions& options) {
  return options.label.empty() ? fmt::format("tag {}", options.tag) : options.label;
}

/// Checks what every transport requires of isend/irecv arguments; raises UsageError naming the rank and op.
inline void check_p2p_args(const char* what, int rank, int world_size, const at::Tensor& tensor,
                           const P2POptions& options) {
  TWOBP_CHECK(options.peer >= 0 && options.peer < world_size && options.peer != rank, UsageError,
              "rank {}: {} {}: peer {} is invalid (world size {}, and a rank cannot talk to itself)", rank, what,
              describe_op(options), options.peer, world_size);
  TWOBP_CHECK(options.tag >= 0, UsageError, "rank {}: {} {}: tag {} must be non-negative", rank, what,
              describe_op(options), options.tag);
  TWOBP_CHECK(options.channel >= 0, UsageError, "rank {}: {} {}: channel {} must be non-negative", rank, what,
              describe_op(options), options.channel);
  TWOBP_CHECK(tensor.defined(), UsageError, "rank {}: {} {}: the tensor is undefined", rank, what,
              describe_op(options));
  TWOBP_CHECK(tensor.is_contiguous(), UsageError, "rank {}: {} {}: the tensor {} must be contiguous", rank, what,
              describe_op(options), describe_tensor(tensor));
}

/// Sleeps between polls of a non-blocking completion test. Starts by yielding (a message between threads or
/// processes on one node usually lands within microseconds) and backs off to `max_sleep` so that a long wait
/// does not burn a core the compute threads need.
class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds max_sleep = std::chrono::microseconds(1000)) : max_(max_sleep) {}

  void pause() {
    if (spins_ < 16) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(max_, sleep_ * 2);
  }

 private:
  std::chrono::microseconds max_;
  std::chrono::microseconds sleep_{1};
  int spins_ = 0;
};

/// Deadline of a wait(timeout); a negative or huge timeout saturates instead of overflowing.
inline Clock::time_point deadline_after(Duration timeout) {
  const auto now = Clock::now();
  if (timeout.count() < 0) return now;
  if (timeout > std::chrono::duration_cast<Duration>(Clock::time_point::max() - now)) return Clock::time_point::max();
  return now + timeout;
}

}  // namespace twobp::detail
