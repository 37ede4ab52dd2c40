#pragma once
// Host wall-clock intervals, as the runtime reports them (trace events, reduction waits).

#include <chrono>

namespace twobp::detail {

/// Microseconds from `since` to now.
inline double elapsed_us(std::chrono::steady_clock::time_point since) {  // twobp::Clock's time_point
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace twobp::detail
