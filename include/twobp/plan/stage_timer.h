#pragma once
// What the 2BP split costs on one stage: the forward F, input gradients I, weight gradients W and the fused
// backward B of a module run as a middle pipeline stage on a fixed input and output gradient. 2BP pays when I + W
// costs about what B does; this measures it on the user's own module (`twobp_bench split` is a command line over
// it, docs/BENCHMARKS.md defines its outputs).
//
//   StageTimer timer(module, [raw](const at::Tensor& x) { return raw->forward(x); }, input);
//   for (int k = 0; k < repeats; ++k) { StageTimer::Split s = timer.split(false); StageTimer::Fused b = timer.fused(false); }
//
// Every phase ends with a device synchronisation, so its time is its own; a StageTimer is used by one thread.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "twobp/stage.h"

namespace twobp {

namespace detail {
class MasterWeights;
}

/// What now_ms() measures.
enum class TimerClock {
  kWall,  ///< steady clock: what a user waits for
  /// CPU time of the whole process: steadier on a shared machine (it does not count waiting for a core), but with
  /// several intra-op threads it counts their spin-waiting too, so it measures speed only with one thread.
  kProcessCpu,
};
/// "wall" or "cpu"; throws UsageError naming both for anything else.
TimerClock parse_clock(const std::string& name);
/// Now on `clock`, in milliseconds from an arbitrary origin.
double now_ms(TimerClock clock);

/// One phase's time in milliseconds: until its last call returned (host) and until the device finished it
/// (synced; equal on the CPU but for the synchronisation's own cost).
struct PhaseTime {
  double synced_ms = 0.0;
  double host_ms = 0.0;
};

struct StageTimerOptions {
  /// Mixed precision as the pipeline runs it (MixedPrecisionOptions): the module computes in the input's dtype
  /// (bfloat16) behind float32 master weights, and every W or B accumulates into the masters' gradients. Off: the
  /// module is converted to the input's dtype.
  bool mixed_precision = false;
  TimerClock clock = TimerClock::kWall;
  /// Record each phase's allocation peak (peak_above_phase_start_bytes) where the device keeps statistics. It
  /// resets the device's peak before every phase: on a GPU that statistic is the whole process's, so turn this off
  /// when other threads of the process compute on the same device (rank threads), whose peaks it would reset.
  bool record_memory = true;
};

/// A module run as stage 1 of 3 (its input gets a gradient, it has no loss) on `input` and a random output
/// gradient of its output's shape (drawn from LibTorch's default generator once, at construction: a process-wide
/// generator, so construct timers on one thread).
class StageTimer {
 public:
  /// The module is moved to the input's device (float32 first; see StageTimerOptions::mixed_precision). One
  /// untimed forward tells the output's shape. Throws UsageError when mixed_precision is set and the input is not
  /// bfloat16 or float16.
  StageTimer(std::shared_ptr<torch::nn::Module> module, StageForward forward, at::Tensor input,
             StageTimerOptions options = {});
  ~StageTimer();
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

  struct Split {
    PhaseTime forward, input, weight;
  };
  struct Fused {
    PhaseTime forward, backward;
  };
  /// F, I, W of micro-batch 0, each synced. `existing_gradients`: into gradients that exist (a later micro-batch
  /// of a step: zeros where there were none) instead of none (the first).
  Split split(bool existing_gradients);
  /// F, B of micro-batch 0, each synced, gradients as for split().
  Fused fused(bool existing_gradients);

  /// One phase run under metrics::AtenOpCounter: its top-level ATen operators and its host time outside them.
  struct PhaseOps {
    std::string phase;  ///< "F", "I", "W" or "B"
    std::int64_t ops = 0;
    double host_overhead_us = 0.0;
    std::map<std::string, std::int64_t> by_name;  ///< only when asked for
  };
  /// F, I, W, then F, B into existing gradients (a step's steady state), counted; untimed otherwise (the counter
  /// slows every operator). Host time is thread CPU time on the CPU under TimerClock::kProcessCpu, else wall time.
  std::vector<PhaseOps> count_ops(bool by_name);

  /// Device-timed phases (GPU): F, I, W, then F, B enqueued without synchronising in between, timed by events on
  /// the stream between them, as the executor's device timeline times actions. Throws UsageError on the CPU.
  struct DeviceTimes {
    double forward_ms = 0.0, input_ms = 0.0, weight_ms = 0.0, backward_ms = 0.0;
  };
  DeviceTimes device_timed();

  /// The W of `micro_batches` micro-batches in one call (`batched`, as 2BP batches deferred W's) or one call each;
  /// their F and I run first, untimed.
  PhaseTime weight_batch(int micro_batches, bool batched);

  /// F, I and W of micro-batch 0, untimed, from no gradients: the output, "input gradient" (when defined) and
  /// "<parameter name>.grad" (the master's under mixed precision), each in float32 -- to compare two modules
  /// built from the same weights and data.
  std::map<std::string, at::Tensor> values();

  /// The output gradient every I, W and B starts from.
  const at::Tensor& grad_output() const { return grad_output_; }
  /// Elements of the module's parameters, each tensor once.
  std::int64_t parameter_count() const;
  /// Where the input's device keeps allocator statistics (metrics/memory.h; CPU: only when its counter is
  /// installed): the most bytes one phase allocated above what was allocated when it began (activations and
  /// gradients, not the weights), and the peak bytes allocated over every timed phase. -1 when not measurable or
  /// not recorded (StageTimerOptions::record_memory).
  std::int64_t peak_above_phase_start_bytes() const { return peak_above_start_; }
  std::int64_t peak_bytes() const { return peak_; }

 private:
  template <typename Fn>
  PhaseTime timed(Fn&& fn);
  void synchronize() const;
  void prepare_gradients(bool existing);

  std::shared_ptr<torch::nn::Module> module_;
  at::Tensor input_;
  StageTimerOptions options_;
  bool measurable_ = false;
  std::unique_ptr<detail::MasterWeights> masters_;
  std::vector<at::Tensor> gradient_holders_;  // the trainable parameters, or their masters
  std::unique_ptr<Stage> stage_;
  at::Tensor grad_output_;
  std::int64_t peak_above_start_ = -1, peak_ = -1;
};

/// Two modules' StageTimer::values() compared -- the same function computed with other kernels or layers, on the
/// same weights and data: the largest relative difference ||a - b|| / ||b|| over the entries both hold (a NaN
/// counts as the largest), where it is, and the entries of `b` that `a` lacks or holds in another shape.
struct ValueComparison {
  int compared = 0;
  double max_relative_difference = 0.0;
  std::string worst;                      ///< the entry of the largest difference
  std::vector<std::string> not_compared;  ///< in `b`, missing from `a` or of another shape
  /// Every entry of `b` compared, and each within `tolerance`.
  bool within(double tolerance) const {
    return compared > 0 && not_compared.empty() && max_relative_difference <= tolerance;
  }
};
ValueComparison compare_values(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b);

}  // namespace twobp
