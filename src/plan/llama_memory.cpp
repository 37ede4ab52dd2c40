#include "twobp/plan/llama_memory.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "twobp/metrics/units.h"
#include "twobp/plan/recompute.h"
#include "twobp/schedule/simulate.h"

namespace twobp {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The partition's compute estimates as costs (I and W each ~ one forward; B = I + W), for the bubble.
SimulationResult simulate_partition(const Schedule& schedule, const models::Partition& partition) {
  CostModel costs;
  for (int s = 0; s < schedule.num_stages; ++s) {
    const double c = std::max(0.05, partition.cost[s]);
    costs.forward.push_back(c);
    costs.backward_input.push_back(c);
    costs.backward_weight.push_back(c);
    costs.backward.push_back(2 * c);
  }
  return simulate(schedule, costs);
}

nlohmann::json stages_json(const models::LlamaConfig& config, const models::Partition& partition,
                           const Schedule& schedule, const models::MemoryPlanOptions& mo) {
  nlohmann::json stages = nlohmann::json::array();
  const int64_t b = mo.precision.compute_bytes;
  for (int s = 0; s < schedule.num_stages; ++s) {
    const models::ChunkSpec& spec = partition.chunks[s];
    stages.push_back(
        {{"stage", s},
         {"rank", schedule.stage_to_rank[s]},
         {"first_layer", spec.first_layer},
         {"end_layer", spec.end_layer},
         {"embedding", spec.has_embedding},
         {"head", spec.has_head},
         {"parameters", models::chunk_parameter_count(config, spec)},
         {"cost", partition.cost[s]},
         {"activation_bytes_per_micro_batch",
          models::chunk_activation_bytes(config, spec, mo.micro_batch_size, mo.seq_len, b)},
         {"pending_weight_bytes_per_micro_batch",
          models::chunk_pending_weight_bytes(config, spec, mo.micro_batch_size, mo.seq_len, b)}});
  }
  return stages;
}

// The run in one line.
std::string headline(const models::LlamaConfig& config, const models::Partition& partition, const Schedule& schedule,
                     const models::MemoryPlanOptions& mo) {
  const bool every_rank = static_cast<int>(mo.recompute_ranks.size()) == schedule.num_ranks;
  const std::string recompute = !mo.recompute ? ""
                                : every_rank  ? ", recompute"
                                              : fmt::format(", recompute on rank{} {}",
                                                            mo.recompute_ranks.size() > 1 ? "s" : "",
                                                            format_ranks(mo.recompute_ranks));
  const int64_t parameters = models::parameter_count(config);
  return fmt::format("model {}: {} parameters ({:.3f} B), {} stages over {} ranks, schedule {} ({}), partition {} "
                     "(imbalance {:.3f}), precision {}{}, micro-batch {} x {} tokens, m = {}",
                     config.name, parameters, parameters / 1e9, schedule.num_stages, schedule.num_ranks, schedule.name,
                     to_string(schedule.backward), partition.layout(), partition.imbalance(),
                     to_string(mo.precision.precision), recompute, mo.micro_batch_size, mo.seq_len,
                     schedule.num_micro_batches);
}

}  // namespace

LlamaMemoryReport llama_memory_report(const models::LlamaConfig& config, const models::Partition& partition,
                                      const Schedule& schedule, const models::MemoryPlanOptions& mo,
                                      double budget_bytes) {
  const SimulationResult sim = simulate_partition(schedule, partition);
  const std::vector<models::RankMemoryEstimate> ranks = models::estimate_memory(config, partition, schedule, mo);
  LlamaMemoryReport report;
  nlohmann::json j;
  j["parameters"] = models::parameter_count(config);
  j["simulated_bubble_fraction"] = sim.bubble_fraction;
  j["precision"] = to_string(mo.precision.precision);
  j["recompute"] = mo.recompute;
  if (mo.recompute && static_cast<int>(mo.recompute_ranks.size()) != schedule.num_ranks) {
    j["recompute_ranks"] = mo.recompute_ranks;
  }
  j["memory_formula"] =
      "twobp::models::memory_model + twobp::simulate_peak_memory: base = parameters x (compute + master + AdamW "
      "bytes); per stage F keeps chunk_activation_bytes (recompute: the input), I keeps chunk_pending_weight_bytes "
      "until W, the first W or B allocates the gradients; message buffers not counted";
  j["stages"] = stages_json(config, partition, schedule, mo);
  report.lines.push_back(headline(config, partition, schedule, mo));
  j["ranks"] = nlohmann::json::array();
  const bool judged = budget_bytes > 0;
  for (int r = 0; r < schedule.num_ranks; ++r) {
    const models::RankMemoryEstimate& e = ranks[r];
    const bool fits = !judged || e.total <= budget_bytes;
    report.fits = report.fits && fits;
    nlohmann::json row{{"rank", r},
                       {"parameters", e.parameters},
                       {"weights_bytes", e.weights},
                       {"master_weights_bytes", e.master_weights},
                       {"optimizer_bytes", e.optimizer},
                       {"gradient_bytes", e.gradients},
                       {"activation_bytes", e.activations},
                       {"pending_weight_bytes", e.pending_weights},
                       {"peak_live_micro_batches", sim.peak_live_micro_batches[r]},
                       {"memory_bytes", e.total}};
    if (judged) row["fits"] = fits;
    j["ranks"].push_back(row);
    using metrics::human_bytes;
    report.lines.push_back(fmt::format(
        "  rank {}: stages {}, {} parameters | weights {}, masters {}, AdamW {}, grads {} | activations {}, pending "
        "W {} | total {}{}",
        r, fmt::join(schedule.stages_of(r), ","), e.parameters, human_bytes(e.weights), human_bytes(e.master_weights),
        human_bytes(e.optimizer), human_bytes(e.gradients), human_bytes(e.activations),
        human_bytes(e.pending_weights), human_bytes(e.total),
        !judged ? "" : fmt::format(" ({} {:g} GiB)", fits ? "fits" : "DOES NOT FIT", budget_bytes / kGiB)));
  }
  if (judged) {
    j["fits"] = report.fits;
    j["gpu_memory_gb"] = budget_bytes / kGiB;
  }
  report.json = j.dump();
  return report;
}

}  // namespace twobp
