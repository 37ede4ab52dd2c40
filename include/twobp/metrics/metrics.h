#pragma once
// The formulas of the metrics twobp reports, written once and read by the trace (bubble statistics), the simulator,
// the benchmark and the example; docs/BENCHMARKS.md points here. Times may be in any unit, as long as one call
// uses one unit throughout.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace twobp::metrics {

/// Bubble fraction: idle compute time over ranks × step time,
///   Σ_r (step − busy_r) / (p · step)  =  1 − Σ_r busy_r / (p · step),
/// with busy_r the time rank r spent in compute actions (F, I, W, B) and step the step time (the slowest rank's).
/// 0 when there are no ranks or the step took no time.
double bubble_fraction(const std::vector<double>& busy, double step);

/// The same from the busy time summed over `ranks` ranks (what an all-reduce of per-rank busy times gives).
double bubble_fraction(double total_busy, int ranks, double step);

/// Throughput: `items` (samples, tokens) per second of `seconds`; 0 when no time passed.
double per_second(double items, double seconds);

/// An amount per item: energy per token (joules / tokens per step), per sample, ...; 0 when there are no items.
double per_item(double amount, double items);

/// tokens/s = samples/s · tokens per sample (the sequence length); 0 for models without tokens (tokens_per_sample 0).
double tokens_per_s(double samples_per_s, int64_t tokens_per_sample);

/// Memory per rank: a process's bytes over the ranks it holds (ranks as threads share one process, so its peak
/// resident set is split evenly over them; one rank per process keeps the whole).
double memory_per_rank(double process_bytes, int ranks_in_process);

/// Peak tensor memory per rank is not a closed formula: simulate_peak_memory (twobp/schedule/simulate.h) walks a
/// MemoryModel through the schedule -- measured (twobp_bench pipeline) or estimated (twobp::models::memory_model).

/// Time of a ring all-reduce of `bytes` over `ranks` ranks, in seconds: the bandwidth/latency model of the ring
/// algorithm NCCL and MPI use for large messages,
///   2(n − 1)/n · bytes / link_bytes_per_s  +  2(n − 1) · latency_s,
/// since a ring all-reduce is a reduce-scatter then an all-gather, each of n − 1 steps in which every rank sends
/// and receives one 1/n slice of the buffer over its link. It is the model behind nccl-tests' "busbw"
/// (bus bandwidth = algbw · 2(n − 1)/n, doc/PERFORMANCE.md), so a measured busbw is the link_bytes_per_s to give.
/// `link_bytes_per_s` is one rank's link bandwidth in bytes per second (gigabits/s · 1e9 / 8), `latency_s` the
/// cost of one ring step. 0 when n ≤ 1 (nothing to reduce) or bytes = 0. Throws UsageError naming the argument when
/// bytes or latency_s is NaN, infinite or negative, or (n > 1, bytes > 0) link_bytes_per_s is not finite and > 0.
double ring_all_reduce_seconds(double bytes, int ranks, double link_bytes_per_s, double latency_s);

/// Exposed wait of one step: the max over ranks of the time each rank waited after its last action (e.g. for the
/// data-parallel gradient reductions, StepResult::reduce_wait_us), since the step ends when the slowest rank
/// does. Negative waits count as 0; 0 when there are no ranks.
double exposed_wait(const std::vector<double>& wait_per_rank);

/// Quantile q in [0, 1] of `samples` by linear interpolation between the two nearest ranks (q = 0.5: the median,
/// the mean of the two middle samples for an even count), the definition of numpy's default and of every median
/// twobp reports. NaN for no samples.
double quantile(std::vector<double> samples, double q);

/// Order statistics of one series of samples (quantile()'s interpolation); every field NaN for no samples.
struct Summary {
  double min = 0, p25 = 0, median = 0, p75 = 0, max = 0;
  std::size_t count = 0;
};
Summary summarize(const std::vector<double>& samples);

/// Samples per named series (e.g. "fused_ms"), in the order the names were first used: what a benchmark's
/// repetitions collect.
class Series {
 public:
  void add(const std::string& name, double value);
  /// UsageError naming the series when there is none of that name.
  const std::vector<double>& get(const std::string& name) const;
  bool has(const std::string& name) const;
  double median(const std::string& name) const { return summarize(get(name)).median; }
  const std::vector<std::pair<std::string, std::vector<double>>>& all() const { return series_; }

 private:
  std::vector<std::pair<std::string, std::vector<double>>> series_;
};

/// The 1-minute load average of the machine (/proc/loadavg); -1 where unavailable. Recorded beside timings, so
/// that a noisy run shows.
double load_average();

/// When `load` (the load average) exceeds the machine's cores -- other processes then take cores from the timed
/// threads -- the line "<command>: warning: load average L on C cores; other processes take cores from the timed
/// threads, see the spread (or use <quieter>)"; empty otherwise.
std::string load_warning(const std::string& command, const std::string& quieter, double load = load_average());

}  // namespace twobp::metrics
