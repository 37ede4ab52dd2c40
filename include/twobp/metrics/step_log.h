#pragma once
// A training run's steps as a program reports them: one record per step, its progress line, the closing summary
// and the JSON array, written once for every trainer (examples/llama_pipeline uses them).

#include <optional>
#include <string>
#include <vector>

namespace twobp::metrics {

struct StepRecord {
  int step = 0;  ///< 0-based
  double loss = 0;
  double tokens_per_s = 0;
  double grad_norm = 0;
  double lr = 0;
  double peak_memory_bytes = 0;  ///< max over the pipeline's ranks of StepResult::peak_memory_bytes (< 0: unknown)
  std::optional<double> energy_j;  ///< the whole job's, this step (twobp/metrics/energy.h); nullopt: not measured
  std::optional<double> j_per_token;
  std::optional<double> eval_loss;  ///< the held-out split's mean loss after this step's update, when evaluated
  bool skipped = false;             ///< the step's update was dropped (a non-finite loss or gradient)
  /// Whether the peak stayed within a memory limit (nullopt: no limit, or memory not measured).
  std::optional<bool> memory_limit_held;
};

/// "step     3/20 | loss 4.1234 | [update skipped (non-finite) | ][val loss ... (ppl ...) | ]grad norm ... | lr ... |
/// ... tok/s | peak ... MiB[ (over the ... MiB limit)] | [... J/tok | ]elapsed ...s | remaining ...s", of `steps`
/// in all; `memory_limit_bytes`: the limit an exceeded peak is said against.
std::string format_step(const StepRecord& r, int steps, double elapsed_s, double remaining_s,
                        double memory_limit_bytes);

/// The progress line of a run of several long items (a benchmark's configurations), printed as item `k` of `total`
/// starts (k from 1): "configuration 3/12 | elapsed 41.0s | remaining ~205.0s". The remaining time assumes each
/// item left takes the mean of those done ("remaining ?" before the first is done). UsageError unless
/// 1 <= k <= total.
std::string format_progress(const std::string& what, int k, int total, double elapsed_s);

/// The closing lines: "done: N steps (to step S) in ... s | final loss ... | mean loss ... | median ... tok/s" (the
/// upper median) and, where some step had a memory limit, "memory limit held on H of L steps". None for no records.
std::vector<std::string> summarize_steps(const std::vector<StepRecord>& records, double wall_s);

/// The records as a JSON array of objects: step, loss, tokens_per_s, grad_norm, lr, peak_memory_bytes, energy_j and
/// j_per_token (null when not measured); skipped, memory_limit_held, eval_loss and eval_perplexity where set.
std::string steps_json(const std::vector<StepRecord>& records);

}  // namespace twobp::metrics
