#pragma once
// An overlap hook (ExecutorOptions::overlap_forward_backward) that really runs an overlapped pair's two parts at
// once: the F on a thread of its own, the B (or I) on the calling thread; counts its calls.

#include <atomic>
#include <exception>
#include <functional>
#include <thread>

#include "twobp/schedule/schedule.h"

namespace twobp::testing {

inline auto concurrent_overlap(std::atomic<int>& calls) {
  return [&calls](const Action&, const Action&, const std::function<void()>& run_forward,
                  const std::function<void()>& run_backward) {
    ++calls;
    std::exception_ptr forward_error;
    std::thread forward([&] {
      try {
        run_forward();
      } catch (...) {
        forward_error = std::current_exception();
      }
    });
    std::exception_ptr backward_error;
    try {
      run_backward();
    } catch (...) {
      backward_error = std::current_exception();
    }
    forward.join();
    if (forward_error) std::rethrow_exception(forward_error);
    if (backward_error) std::rethrow_exception(backward_error);
  };
}

// The number of overlapped F&B pairs (Action::overlapped_with_next) in a schedule.
inline int overlapped_pairs(const Schedule& schedule) {
  int n = 0;
  for (const auto& list : schedule.actions) {
    for (const Action& a : list) n += a.overlapped_with_next ? 1 : 0;
  }
  return n;
}

}  // namespace twobp::testing
