#pragma once
// Planning a LLaMa-like stack (twobp/models/llama.h): what each action costs on each chunk of a partition --
// estimated from FLOPs, or fitted to a run's measured costs (twobp/plan/measure.h) -- and every dp × pp layout,
// schedule, mode and recomputation ranked by the simulator's throughput among those that fit in memory. The "plan"
// third of measure → plan → run for this model family; `twobp_bench plan` is a command line over it.
//
//   LlamaCosts costs = fit_llama_costs(measured_model, seq, runs).carried(measured_model, seq, 1, model, seq, 1);
//   LayoutPlanOptions o;  o.ranks = 8;  o.global_batch = 64;  o.seq = seq;  o.memory_limit_bytes = 80.0 * (1 << 30);
//   LayoutPlan plan = plan_llama_layouts(model, costs, o);      // plan.candidates.front(): the best that fits
//
// Units: milliseconds, bytes.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "twobp/models/llama.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/recompute.h"
#include "twobp/plan/record.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/synthesize.h"

namespace twobp {

/// One action type's cost (ms) on a chunk, affine in what the chunk holds:
///   per_action + per_block · blocks + embedding · [holds the embedding] + head · [holds the final norm + head]
/// per_action is the planner's fixed cost per action (what CostModel::per_action models for per-rank costs): fitted
/// where the runs' chunk shapes determine it, given (estimate_llama_costs, fit_llama_costs' per_action_ms,
/// `twobp_bench plan --action-ms`) where they do not; cost_model() charges it inside each stage's costs, so that
/// the planner's CostModel::per_action stays 0 and the one value is not counted twice.
struct ChunkCost {
  double per_action = 0, per_block = 0, embedding = 0, head = 0;

  double of(const models::ChunkSpec& chunk) const;
  bool is_zero() const { return per_action == 0 && per_block == 0 && embedding == 0 && head == 0; }
  ChunkCost scaled(double k) const;
  ChunkCost operator+(const ChunkCost& other) const;
  /// "a + b/block + e embedding + h head" (3 significant digits).
  std::string str() const;
};

/// F, I, W and B per chunk of one model at one sequence length and micro-batch size, and how they were obtained.
struct LlamaCosts {
  enum class Kind {
    kEstimated,   ///< from FLOPs and a device's rate (estimate_llama_costs)
    kFitted,      ///< all four terms of each action type fitted to measured chunks (fit_llama_costs)
    kFlopShares,  ///< measured, with one chunk shape only: F at its FLOP shares, I, W, B at their ratios to F
  };
  Kind kind = Kind::kEstimated;
  ChunkCost forward, backward_input, backward_weight, backward;
  /// The fixed part of every W, whatever its number of micro-batches (CostModel::backward_weight_fixed): a W of k
  /// micro-batches costs backward_weight_fixed + k · backward_weight. All terms 0: none (estimated costs, and
  /// measured runs whose W's came in one size only).
  ChunkCost backward_weight_fixed;
  /// Overlapped F&B pairs (DualPipeV's) run at once: the share of a pair's shorter part hidden under the longer
  /// (CostModel::overlap, [0, 1]); 0: in order. Fitted as the mean of the runs' MeasuredCosts::overlap weighted by
  /// their overlapped_pairs (0 when no run ran pairs at once); a share, so carried() keeps it. It holds only for a
  /// runtime that overlaps the pairs (PipelineOptions::executor.overlap_forward_backward).
  double overlap = 0.0;
  std::string how;                    ///< one line for people: the terms, or the rate and ratios
  std::vector<std::string> warnings;  ///< e.g. a fitted term that came out negative (noise)

  /// The same costs on model `to` at `to_seq` tokens and `to_micro_batch_size` sequences per micro-batch:
  /// block and head terms scaled by their FLOPs (models::block_forward_flops, head_forward_flops), the embedding
  /// by its output elements (sequences · tokens · dim), the per-action term unchanged. The fixed W part is not
  /// scaled: it is what a W costs apart from its micro-batches' work (per block as many weights, not FLOPs).
  LlamaCosts carried(const models::LlamaConfig& from, int64_t from_seq, int64_t from_micro_batch_size,
                     const models::LlamaConfig& to, int64_t to_seq, int64_t to_micro_batch_size) const;

  /// The simulator's costs of `partition`'s chunks as stages in `mode`: F; I and W (kSplit; 0 in kStandard), and
  /// in kSplit W's fixed part where there is one (at least 0 per chunk); B (the fused backward: every B of a
  /// standard form, the fused ones of a 2BP form); R = F when `recompute`; `communication_ms` per message; the
  /// overlap. A chunk's cost is clamped at 1e-9 ms: a fitted term may be negative and no action is free.
  CostModel cost_model(const models::Partition& partition, BackwardMode mode, bool recompute,
                       double communication_ms) const;
};

/// "estimated", "fitted" or "flop_shares" (the names in `twobp_bench plan --json`).
const char* llama_costs_kind_name(LlamaCosts::Kind kind);

/// The backward actions' costs as multiples of the forward's, for costs estimated from FLOPs.
struct BackwardRatios {
  double input = 1.0;   ///< I / F
  double weight = 1.0;  ///< W / F
  double fused = 2.0;   ///< B / F
  std::string source = "FLOP counts";  ///< where they come from (said in LlamaCosts::how)
};
/// What a run measured, the default of estimate_llama_costs: the fast path of one LLaMa-7B stage (8 blocks,
/// bfloat16, micro-batch 1, seq 4096) on an H200, docs/GPU.md: F 31.86, I 40.49, W 22.05, B 62.69 ms, i.e.
/// I = 1.271 F, W = 0.692 F, B = 1.968 F (the attention backward and the element-wise work belong to I).
BackwardRatios measured_backward_ratios();
/// FLOP counts alone: every GEMM of F has one of the same size in I and one in W, so I = W = F, B = 2F.
BackwardRatios flop_backward_ratios();
/// The ratios of measured times (e.g. a `twobp_bench split` path's forward_ms, stage1_ms, stage2_ms, fused_ms).
/// Throws UsageError unless all are positive.
BackwardRatios backward_ratios(double forward_ms, double input_ms, double weight_ms, double fused_ms,
                               std::string source);

/// Costs from FLOPs: F per block = block_forward_flops · micro_batch_size / `tflops` (TFLOP/s sustained), the
/// head at its FLOP share of a block (head_cost_in_blocks), no embedding term; I, W and B at `ratios` of F; plus
/// `per_action_ms` as the per-action term of every F, I and B and of W's fixed part (once per W, whatever its
/// micro-batches; 0: none). Throws UsageError unless tflops > 0, the sizes and the ratios are positive and
/// per_action_ms is a finite time in [0, 1e9].
LlamaCosts estimate_llama_costs(const models::LlamaConfig& config, int64_t seq, int64_t micro_batch_size,
                                double tflops, const BackwardRatios& ratios = measured_backward_ratios(),
                                double per_action_ms = 0.0);

/// One measured run of the model cut by `partition` (a stage per chunk): its costs (MeasuredCosts, e.g. read with
/// parse_measured_costs) and the mode it ran in (F from either; I and W from kSplit; B from kStandard).
struct MeasuredLlamaRun {
  models::Partition partition;
  BackwardMode mode = BackwardMode::kSplit;
  MeasuredCosts costs;
};

/// Fits each action type's ChunkCost to the runs' chunks by least squares. All four terms need chunks of enough
/// shapes (full column rank of the rows (1, blocks, embedding?, head?): e.g. the chunks of one v = 1 and one v = 2
/// pipeline); B falls back to I + W0 + W when no standard run determines it. W0, the fixed part of every W, is fitted
/// as the others from the runs' measured MeasuredCosts::backward_weight_fixed (0 for a run without); all zero
/// when no run has one. With too few shapes (a single v = 1 pipeline cannot tell the head from the per-action
/// cost) the result is Kind::kFlopShares: F per block = Σ F / Σ partition cost (blocks + head share), the head at
/// its share, and I, W, W0, B at their summed ratios to F (B = I + W0 + W without a standard run). A negative
/// fitted term adds a warning. The overlap: see LlamaCosts::overlap.
/// `per_action_ms` (measured elsewhere, e.g. `twobp_bench split` at two --layers) is the fixed cost each measured
/// action held once: with too few shapes the shares then spread Σ cost − per_action_ms per action, and every F, I,
/// B and W's fixed part (W0, or once per W when no W0 was measured) gets it as its per-action term, so that the
/// measured partition's totals are kept and a partition of more chunks pays it more often. Where the shapes
/// determine the per-action terms it is refused (UsageError: a second value for the same term).
/// Throws UsageError when the runs hold no 2BP run (I and W) or no forward cost, a run's cost lists are not one
/// entry per chunk of its partition, per_action_ms is not a finite time in [0, 1e9], or it leaves an action type's
/// measured total no time for its work.
LlamaCosts fit_llama_costs(const models::LlamaConfig& config, int64_t seq, const std::vector<MeasuredLlamaRun>& runs,
                           std::optional<double> per_action_ms = std::nullopt);

/// The LLaMa-like model a run document measured (RunDocument::model, its "config"), named "measured". Throws
/// UsageError naming `where` (its files) when the document has no config or measured another model.
models::LlamaConfig measured_llama_config(const RunDocument& doc, const std::string& where);

/// Costs of the model `to` from a run document (`twobp_bench pipeline --json`, `llama_pipeline --costs-json`):
/// fit_llama_costs over every plain result (RunRecord::plain; a record of both modes counts for each,
/// measured_modes), each in the partition it names (balanced when none), carried to `to` at `to_seq` tokens and
/// `to_micro_batch_size` sequences per micro-batch.
struct DocumentCosts {
  LlamaCosts costs;
  /// The first 2BP result's message time per byte of its activation (a float32 micro-batch of hidden states; the
  /// latency is not separable from one size).
  double comm_ms_per_byte = 0.0;
  std::vector<std::string> used;  ///< "<schedule> <mode> p=<p> v=<v>" of each result fitted
};
/// `per_action_ms`: fit_llama_costs'. Throws UsageError naming `where` as measured_llama_config does, or when the
/// document holds no 2BP result (measure one: `twobp_bench pipeline --mode both`); fit_llama_costs' errors otherwise.
DocumentCosts fit_run_document(const RunDocument& doc, const std::string& where, const models::LlamaConfig& to,
                               int64_t to_seq, int64_t to_micro_batch_size,
                               std::optional<double> per_action_ms = std::nullopt);

/// What plan_llama_layouts considers.
struct LayoutPlanOptions {
  int ranks = 1;                 ///< GPUs: dp · pp
  int64_t seq = 0;               ///< tokens per sequence (> 0)
  int64_t micro_batch_size = 1;  ///< sequences per micro-batch
  int64_t global_batch = 0;      ///< sequences per step: m = global_batch / (dp · micro_batch_size) per replica
  int max_dp = 0;                ///< data-parallel degrees up to this (0: up to ranks)
  std::vector<std::string> schedules;  ///< registered names (empty: all)
  std::vector<BackwardMode> modes{BackwardMode::kStandard, BackwardMode::kSplit};
  /// false: no stage recomputes; true: the stages of the first 1 .. pp ranks of recompute_order (by each rank's
  /// estimated peak without recomputation, highest first) recompute, one candidate each
  /// (LayoutCandidate::recompute_ranks): recomputing where the memory is alone can fit a limit at less cost than
  /// recomputing everywhere.
  std::vector<bool> recompute{false, true};
  models::TrainingPrecision precision = models::training_precision(Precision::kMixedBFloat16);
  double memory_limit_bytes = 0;  ///< per device; 0: every candidate fits
  double communication_ms = 0;    ///< one activation message between neighbouring stages
  double link_bytes_per_s = 0;    ///< data-parallel all-reduce bandwidth per rank (needed when some dp > 1)
  double link_latency_s = 0;      ///< per ring step
  /// The search of `synth`, synthesized for these costs per layout and mode (make_schedule_for_costs).
  SynthesisOptions synthesis = SynthesisOptions::planning();
};

/// One layout, schedule, mode and recomputation with its prediction.
struct LayoutCandidate {
  std::string schedule;
  BackwardMode mode = BackwardMode::kSplit;
  int dp = 1, pp = 1, v = 1, m = 1;
  /// The pipeline ranks whose stages recompute their activations, ascending (empty: none; format_ranks and the
  /// example's --recompute --recompute-on write them; AutoSchedule's ScheduleCandidate::recompute_ranks).
  std::vector<int> recompute_ranks;
  double step_ms = 0;        ///< simulate(schedule, costs).step_time, dp all-reduces overlapped
  double tokens_per_s = 0;   ///< global_batch · seq per step
  double bubble = 0;         ///< the simulator's bubble fraction
  std::vector<double> memory_per_rank;  ///< models::estimate_memory totals (bytes)
  double peak_memory = 0;
  bool fits = true;
};

struct LayoutPlan {
  /// Fitting candidates first, each group by predicted tokens/s (ties: less peak memory).
  std::vector<LayoutCandidate> candidates;
  /// Shapes left out: a schedule or the partition rejected them, or several chunks on a one-rank pipeline
  /// (pp = 1 with v > 1 cuts the same work into more actions).
  int skipped = 0;
};

/// Every dp dividing `ranks` (≤ max_dp) with dp · micro_batch_size dividing global_batch, pp = ranks / dp, every
/// schedule (its default v for pp and m), mode and recomputation setting: each rank's stages cut by
/// models::make_partition, costs from `costs.cost_model` (R only on the recomputing ranks' stages) plus each
/// stage's gradient all-reduce over dp ranks (metrics::ring_all_reduce_seconds of its parameters ·
/// precision.gradient_bytes), the step from simulate(), the memory from models::estimate_memory. Throws UsageError
/// on bad options (a communication, latency or bandwidth that is NaN, infinite or negative, a NaN memory limit:
/// "plan_llama_layouts: LayoutPlanOptions.<field> is ...") or when no candidate remains (naming why).
LayoutPlan plan_llama_layouts(const models::LlamaConfig& config, const LlamaCosts& costs,
                              const LayoutPlanOptions& options);

}  // namespace twobp
