#pragma once
// Host wall-clock intervals, as the runtime reports them (trace events, reduction waits).

#include <chrono>

#include "twobp/transport/transport.h"  // twobp::Clock

namespace twobp::detail {

/// Microseconds from `since` to now.
inline double elapsed_us(Clock::time_point since) {
  return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
}

}  // namespace twobp::detail
