#pragma once
// A LLaMa run's sizes and memory per rank from formulas, nothing allocated (a program's --dry-run): each stage's
// layers, parameters and bytes per micro-batch, each rank's estimate (models::estimate_memory: the formulas of
// models::memory_model walked through the schedule by simulate_peak_memory) and whether it fits a budget.

#include <string>
#include <vector>

#include "twobp/models/llama.h"
#include "twobp/schedule/schedule.h"

namespace twobp {

struct LlamaMemoryReport {
  /// A JSON object: "parameters", "simulated_bubble_fraction" (the partition's compute estimates: I and W each one
  /// F, B = I + W), "precision", "recompute" (and "recompute_ranks" when not every rank), "memory_formula",
  /// "stages" (stage, rank, first_layer, end_layer, embedding, head, parameters, cost,
  /// activation_bytes_per_micro_batch, pending_weight_bytes_per_micro_batch), "ranks" (rank, parameters,
  /// weights_bytes, master_weights_bytes, optimizer_bytes, gradient_bytes, activation_bytes, pending_weight_bytes,
  /// peak_live_micro_batches, memory_bytes, and "fits" with a budget) and, with a budget, "fits" and
  /// "gpu_memory_gb".
  std::string json;
  /// For people: the run in one line, then one line per rank.
  std::vector<std::string> lines;
  bool fits = true;  ///< every rank within the budget (true without one)
};

/// The report of `schedule` running `partition`'s chunks of `config` with `options`; `budget_bytes` per rank (0: do
/// not judge).
LlamaMemoryReport llama_memory_report(const models::LlamaConfig& config, const models::Partition& partition,
                                      const Schedule& schedule, const models::MemoryPlanOptions& options,
                                      double budget_bytes = 0);

}  // namespace twobp
