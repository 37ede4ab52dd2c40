#pragma once
// Timeline of what each rank did in a step: the raw material for bubble statistics and pictures.

#include <cstdint>
#include <string>
#include <vector>

#include "twobp/schedule/action.h"
#include "twobp/transport/transport.h"

namespace twobp {

/// One executed action. Times are microseconds since the recording rank entered Pipeline::step: on the host's
/// steady clock for CPU transports; on a GPU transport from timing events on the rank's current stream (when the
/// GPU ran the action, not when the host enqueued it).
/// Ranks' clocks are not synchronised: a trace of several ranks is aligned at their step starts, which is exact
/// only as far as the ranks enter the step together (twobp_bench puts a barrier right before it; see
/// docs/BENCHMARKS.md).
struct TraceEvent {
  int rank = 0;
  Action action;
  double start_us = 0.0;
  double end_us = 0.0;
  /// Activation recomputation: the part of this I or B spent re-running the forward first (host time), else 0.
  double recompute_us = 0.0;
  /// Tensor memory of the rank in bytes (twobp/metrics/memory.h), when the pipeline records it
  /// (PipelineOptions::executor.record_memory), else -1: allocated before the action (including the receives it posts
  /// ahead), after it, and the most while it ran.
  int64_t memory_before = -1, memory_after = -1, memory_peak = -1;
};

/// Whether events[k] opens an overlapped F&B pair that ran at once (ExecutorOptions::overlap_forward_backward): an
/// F with Action::overlapped_with_next whose next event has the same span -- the executor records both parts over
/// the pair's span. (Pairs run without a hook, one part after the other, are two ordinary events.) The one rule
/// for telling such a pair in a trace.
bool ran_as_pair(const std::vector<TraceEvent>& events, std::size_t k);

struct Trace {
  std::vector<TraceEvent> events;
  double step_us = 0.0;  ///< wall time of the step on the recording rank

  /// Time spent in compute actions (F, I, W, B); a pair that ran at once (ran_as_pair) counts once.
  double busy_us() const;
  /// metrics::bubble_fraction of this rank alone, (step - busy) / step: the share of the step it spent waiting
  /// (bubble plus communication waits). Deprecated in 0.2.0, kept in 0.3.0, to be removed in 0.4.0: nothing uses
  /// it; the step's attribution (twobp/trace/attribution.h) says where a rank's time went, waits by cause.
  [[deprecated("use metrics::bubble_fraction({trace.busy_us()}, trace.step_us), or attribute() for waits by cause")]]
  double idle_fraction() const;
};

/// metrics::bubble_fraction (twobp/metrics/metrics.h) of the ranks' busy times, with step the slowest rank's step
/// time.
double bubble_fraction(const std::vector<Trace>& ranks);

/// Every rank's trace on every rank, by rank (collective over `transport`: two all-reduces of doubles on the
/// transport's device, sized by the longest trace). Each event arrives whole: action (all its micro-batches, the
/// overlap flag), times, recompute time and memory. Made for one step's trace, not for every step of a run.
std::vector<Trace> gather_traces(Transport& transport, const Trace& mine, Duration timeout);

/// Chrome / Perfetto trace-event JSON ("X" events) for chrome://tracing or ui.perfetto.dev: one track per entry of
/// `ranks`, named "rank <index>" (so pass every rank's trace in rank order, e.g. from gather_traces()).
std::string to_chrome_trace(const std::vector<Trace>& ranks);

/// SVG picture in the style of the pipeline papers: one row per rank, time to the right, F/I/W/B coloured and
/// labelled with the micro-batch, idle time left white.
std::string to_svg(const std::vector<Trace>& ranks, const std::string& title);

}  // namespace twobp
