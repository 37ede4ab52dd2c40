#pragma once
// How many ATen operators a piece of host code launches, and how much of its host time is spent outside them
// (the autograd engine, graph walks, bookkeeping): the measure `twobp_bench split` reports as ops_per_block and
// host_overhead_us. docs/BENCHMARKS.md defines the columns.

#include <cstdint>
#include <map>
#include <string>

namespace twobp::metrics {

struct AtenOpCounterOptions {
  bool by_name = false;  ///< also count the top-level operators by name ("aten::mm")
  /// Time with the calling thread's CPU time instead of the steady clock: on a busy machine a thread waiting for a
  /// core would otherwise be timed as working. Only for code whose operators run on the calling thread (CPU
  /// tensors); autograd runs a GPU backward on its own threads.
  bool thread_cpu_time = false;
};

/// Counts the top-level ATen operators (dispatcher calls, seen through RecordFunction) called on any thread while
/// it is alive: an operator called from inside another one (at::linear calling at::matmul calling at::mm) is part
/// of the outer call and not counted again; the autograd engine's node evaluations are not operators, the
/// operators they call are. Deterministic for a deterministic program, on the CPU as on a GPU.
///
/// NB: it installs a global RecordFunction callback, which costs every operator some time while the counter
/// lives: time the code without it, and count in a separate run. One counter at a time per process.
class AtenOpCounter {
 public:
  struct Counts {
    std::int64_t ops = 0;  ///< top-level operators
    double inside_us = 0;  ///< host time inside them (start callback to end callback), microseconds
    std::map<std::string, std::int64_t> by_name;  ///< with AtenOpCounterOptions::by_name
  };

  explicit AtenOpCounter(AtenOpCounterOptions options = {});
  ~AtenOpCounter();
  AtenOpCounter(const AtenOpCounter&) = delete;
  AtenOpCounter& operator=(const AtenOpCounter&) = delete;

  /// What was counted since construction or the last take(), which starts the next count at zero.
  Counts take();
  /// Now on the counter's clock, in microseconds (arbitrary origin): time the measured code with it.
  double now_us() const;
  /// The host time of code outside its top-level operators: `elapsed_us` (now_us() around the code, with a take()
  /// before it and `counts` = take() after it) minus the time inside them, minus the counter's own clock readings
  /// that fall outside (one reading per operator, its cost measured at construction).
  double outside_us(double elapsed_us, const Counts& counts) const;

  struct State;  // shared with the callback

 private:
  State* state_;
  std::uint64_t handle_ = 0;
  double reading_us_ = 0;  // the cost of one clock reading
};

}  // namespace twobp::metrics
