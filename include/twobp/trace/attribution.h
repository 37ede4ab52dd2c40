#pragma once
// Where a rank's step time went: one measured step cut into parts -- compute by action type, waiting for messages
// by peer, sending, the executor's own time, the data-parallel reduction, the optimizer, and idle time at the end.
// The answer to "why is this schedule not faster here?": a bubble shows up as a wait for a named peer.

#include <array>
#include <map>
#include <string>
#include <vector>

#include "twobp/schedule/schedule.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

namespace twobp {

/// The parts of a step, in the order they are reported and drawn.
enum class StepPart : int {
  kForward,          ///< F actions
  kBackwardInput,    ///< I actions (2BP stage 1), less their recomputation
  kBackwardWeight,   ///< W actions (2BP stage 2, deferred; also a W run early by a memory bound)
  kBackward,         ///< B actions (ordinary fused backward), less their recomputation
  kRecompute,        ///< the part of I and B spent re-running the forward (StageOptions::recompute)
  kOverlappedPair,   ///< overlapped F&B pairs (ExecutorOptions::overlap_forward_backward): each pair's span once
  kSend,             ///< SEND actions: handing a message to the transport
  kWaitActivation,   ///< RECV_F actions: waiting for an activation (by peer: StepAttribution::waits_by_peer_us)
  kWaitGradient,     ///< RECV_B actions: waiting for a gradient
  kBetweenActions,   ///< the executor between actions: before the first, and between consecutive ones
  kFinish,           ///< after the last action: the last sends' completion, the loss copy, end-of-step checks
  kReduceWait,       ///< data parallelism: waiting after the last action for the gradient reductions
  kPipelineOther,    ///< Pipeline::step outside the executor and that wait (first-step barrier, master sync, ...)
  kOptimizer,        ///< the caller's optimizer work (StepTimes::optimizer_us; 0 when not measured)
  kIdleEnd,          ///< after this rank's work until the step ended for the caller (e.g. a closing barrier)
};
constexpr int kNumStepParts = static_cast<int>(StepPart::kIdleEnd) + 1;

/// Short name of a part ("F", "I", "W", "B", "recompute", "F&B pair", "send", "wait F", "wait B", "between",
/// "finish", "dp reduce", "pipeline", "optimizer", "idle end"); also its key in JSON output.
const char* to_string(StepPart part);

/// The times around a step that its trace does not hold. Every field in microseconds.
struct StepTimes {
  /// Pipeline::step's wall time on this rank (StepResult::pipeline_us); < 0: the trace's step_us (an Executor run).
  double pipeline_us = -1.0;
  double reduce_wait_us = 0.0;  ///< StepResult::reduce_wait_us
  double optimizer_us = 0.0;    ///< the caller's optimizer step, norm and clipping, if it measured them
  /// The whole step as the caller measured it, e.g. from a barrier before Pipeline::step to one after the
  /// optimizer; < 0: pipeline_us + optimizer_us (no idle time at the end).
  double step_us = -1.0;
};

/// One rank's step, cut into parts that partition its timeline (each microsecond counted once). The executor's
/// part (actions, between them, finish) comes from the trace, so on a GPU transport it is the GPU's timeline for
/// the actions (TraceEvent) -- not yet run on a GPU.
struct StepAttribution {
  int rank = 0;
  double step_us = 0.0;                           ///< StepTimes::step_us (or what it defaults to)
  std::array<double, kNumStepParts> parts_us{};   ///< indexed by StepPart
  /// Waits (RECV actions) by the peer that sends: [peer] = {activations (RECV_F), gradients (RECV_B)}.
  std::map<int, std::array<double, 2>> waits_by_peer_us;

  double& operator[](StepPart part) { return parts_us[static_cast<int>(part)]; }
  double operator[](StepPart part) const { return parts_us[static_cast<int>(part)]; }
  /// Sum of the parts. Equal to step_us up to rounding when the trace's events do not overlap and the times
  /// given are consistent (pipeline_us >= the trace's step, step_us >= pipeline_us + optimizer_us); the
  /// difference is what attribution could not place (negative: counted twice).
  double parts_sum_us() const;
};

/// Attributes one step of `schedule` (the schedule the executor ran: Pipeline::schedule()) from this rank's trace
/// and the times around it. Throws UsageError when the trace does not belong to `schedule` (a RECV whose peer
/// stage does not exist).
StepAttribution attribute_step(const Schedule& schedule, const Trace& trace, const StepTimes& times = {});

/// The mean over steps, part by part (so the parts of the mean still sum to its step). Throws UsageError for an
/// empty list or steps of different ranks.
StepAttribution mean_attribution(const std::vector<StepAttribution>& steps);

/// Every rank's attribution on every rank, by rank (collective over `transport`: one all-reduce of doubles).
std::vector<StepAttribution> gather_attributions(Transport& transport, const StepAttribution& mine,
                                                 Duration timeout);

/// One line for logs: the step, then each part of at least 0.5 % as a share of it, and the longest wait by peer.
std::string format_attribution(const StepAttribution& a);

/// JSON array, one object per entry of `ranks`: {"rank", "step_ms", "parts_ms": {part name: ms, in StepPart
/// order}, "wait_ms_by_peer": {"<peer>": {"F": ms, "B": ms}}, "unaccounted_ms": step_ms - the sum of the parts}.
/// The one writer of this form: twobp_bench pipeline's "attribution" and llama_pipeline's --json use it.
std::string to_attribution_json(const std::vector<StepAttribution>& ranks);

/// SVG picture: one horizontal stacked bar per rank (rank order), the parts in StepPart order with a legend;
/// bars share one time axis (ms).
std::string to_attribution_svg(const std::vector<StepAttribution>& ranks, const std::string& title);

}  // namespace twobp
