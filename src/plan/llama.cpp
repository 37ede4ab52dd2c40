#include "twobp/plan/llama.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/plan/cost_source.h"
#include "twobp/schedule/registry.h"
#include "util/check.h"
#include "util/cost_check.h"

namespace twobp {

namespace llm = models;

namespace {

// One action type's measured costs: a row (1, blocks, embedding?, head?) and a cost (ms) per chunk.
struct Samples {
  std::vector<std::array<double, 4>> rows;
  std::vector<double> ms;

  void add(const llm::ChunkSpec& c, double cost) {
    rows.push_back({1.0, static_cast<double>(c.num_layers()), c.has_embedding ? 1.0 : 0.0, c.has_head ? 1.0 : 0.0});
    ms.push_back(cost);
  }
  double total() const { return std::accumulate(ms.begin(), ms.end(), 0.0); }

  // Least squares of the four terms (at::linalg_lstsq, gelsd) when the chunk shapes determine all four (full
  // column rank); nullopt otherwise.
  std::optional<ChunkCost> fit() const {
    if (rows.size() < 4) return std::nullopt;
    std::vector<double> flat;
    for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
    const at::Tensor a = at::tensor(flat, at::kDouble).view({static_cast<int64_t>(rows.size()), 4});
    if (at::linalg_matrix_rank(a).item<int64_t>() < 4) return std::nullopt;
    const at::Tensor b = at::tensor(ms, at::kDouble).view({-1, 1});
    const at::Tensor x = std::get<0>(at::linalg_lstsq(a, b, std::nullopt, "gelsd")).flatten();
    return ChunkCost{x[0].item<double>(), x[1].item<double>(), x[2].item<double>(), x[3].item<double>()};
  }
};

// The FLOP-share model of one action type: `block_ms` per block, the head at its FLOP share of a block, no
// per-action or embedding term.
ChunkCost flop_shares(const llm::LlamaConfig& c, int64_t seq, double block_ms) {
  return {0.0, block_ms, 0.0, llm::head_cost_in_blocks(c, seq) * block_ms};
}

// A given per-action cost (CostModel::per_action's model in chunk terms) as the intercept of every action: of each
// F, I and B, and of W's fixed part (once per W, whatever its micro-batches; W per micro-batch has none).
void set_per_action(LlamaCosts& c, double ms) {
  for (ChunkCost* k : {&c.forward, &c.backward_input, &c.backward, &c.backward_weight_fixed}) k->per_action = ms;
}

ChunkCost carried_cost(const ChunkCost& k, const llm::LlamaConfig& from, int64_t from_seq, int64_t from_mbs,
                       const llm::LlamaConfig& to, int64_t to_seq, int64_t to_mbs) {
  const double batch = static_cast<double>(to_mbs) / static_cast<double>(from_mbs);
  return {k.per_action,
          k.per_block * batch * llm::block_forward_flops(to, to_seq) / llm::block_forward_flops(from, from_seq),
          k.embedding * batch * static_cast<double>(to_seq * to.dim) / static_cast<double>(from_seq * from.dim),
          k.head * batch * llm::head_forward_flops(to, to_seq) / llm::head_forward_flops(from, from_seq)};
}

// `out` with the runs' overlap (LlamaCosts::overlap: their shares weighted by the pairs each ran at once), said in
// its `how` when pairs ran at once.
LlamaCosts with_overlap(LlamaCosts out, const std::vector<MeasuredLlamaRun>& runs) {
  double weighted = 0;
  int pairs = 0;
  for (const MeasuredLlamaRun& run : runs) {
    weighted += run.costs.overlap * run.costs.overlapped_pairs;
    pairs += run.costs.overlapped_pairs;
  }
  out.overlap = pairs > 0 ? weighted / pairs : 0.0;
  if (pairs > 0) {
    out.how += fmt::format("; F&B pairs at once, {:.3f} of the shorter part hidden ({} pairs)", out.overlap, pairs);
  }
  return out;
}

// A warning per negative term of a fitted cost.
void warn_negative(const char* name, const ChunkCost& k, std::vector<std::string>& warnings) {
  const std::pair<const char*, double> terms[] = {
      {"per action", k.per_action}, {"per block", k.per_block}, {"embedding", k.embedding}, {"head", k.head}};
  for (const auto& [term, value] : terms) {
    if (value < 0) {
      warnings.push_back(fmt::format("fitted {} cost {} is negative ({:.4g} ms): the measured costs are noisy; "
                                     "measure more steps (--steps) or on an idle machine",
                                     name, term, value));
    }
  }
}

// The memory estimate's options of a candidate whose ranks `recompute_ranks` recompute (none: empty).
llm::MemoryPlanOptions memory_options(const LayoutPlanOptions& o, const std::vector<int>& recompute_ranks) {
  llm::MemoryPlanOptions mo;
  mo.micro_batch_size = o.micro_batch_size;
  mo.seq_len = o.seq;
  mo.precision = o.precision;
  mo.recompute = !recompute_ranks.empty();
  mo.recompute_ranks = recompute_ranks;
  return mo;
}

// One candidate of plan_llama_layouts: `schedule` on `partition` with dp replicas, the stages of the pipeline ranks
// `recompute_ranks` recomputing.
LayoutCandidate predict(const llm::LlamaConfig& config, const LlamaCosts& costs, const LayoutPlanOptions& o,
                        const Schedule& schedule, const llm::Partition& partition, int dp,
                        const std::vector<int>& recompute_ranks) {
  CostModel model = costs.cost_model(partition, schedule.backward, !recompute_ranks.empty(), o.communication_ms);
  for (std::size_t s = 0; s < model.recompute.size(); ++s) {
    // A stage of a rank that does not recompute keeps its activations.
    if (!has_rank(recompute_ranks, schedule.stage_to_rank[s])) model.recompute[s] = 0.0;
  }
  if (dp > 1) {
    std::vector<double> bytes;
    for (const llm::ChunkSpec& chunk : partition.chunks) {
      bytes.push_back(static_cast<double>(llm::chunk_parameter_count(config, chunk) * o.precision.gradient_bytes));
    }
    add_data_parallel(model, schedule, bytes, RingLink{dp, o.link_bytes_per_s, o.link_latency_s});
  }
  const SimulationResult sim = simulate(schedule, model);
  LayoutCandidate k;
  k.schedule = schedule.name;
  k.mode = schedule.backward;
  k.dp = dp;
  k.pp = schedule.num_ranks;
  k.v = schedule.num_stages / schedule.num_ranks;
  k.m = schedule.num_micro_batches;
  k.recompute_ranks = recompute_ranks;
  k.step_ms = sim.step_time;
  k.bubble = sim.bubble_fraction;
  k.tokens_per_s = metrics::tokens_per_s(
      metrics::per_second(static_cast<double>(o.global_batch), sim.step_time / 1000.0), o.seq);
  for (const auto& e : llm::estimate_memory(config, partition, schedule, memory_options(o, recompute_ranks))) {
    k.memory_per_rank.push_back(e.total);
  }
  k.peak_memory = *std::max_element(k.memory_per_rank.begin(), k.memory_per_rank.end());
  k.fits = o.memory_limit_bytes <= 0 || k.peak_memory <= o.memory_limit_bytes;
  return k;
}

}  // namespace

double ChunkCost::of(const llm::ChunkSpec& c) const {
  return per_action + per_block * c.num_layers() + (c.has_embedding ? embedding : 0.0) + (c.has_head ? head : 0.0);
}

ChunkCost ChunkCost::scaled(double k) const { return {k * per_action, k * per_block, k * embedding, k * head}; }

ChunkCost ChunkCost::operator+(const ChunkCost& o) const {
  return {per_action + o.per_action, per_block + o.per_block, embedding + o.embedding, head + o.head};
}

std::string ChunkCost::str() const {
  return fmt::format("{:.3g} + {:.3g}/block + {:.3g} embedding + {:.3g} head", per_action, per_block, embedding,
                     head);
}

const char* llama_costs_kind_name(LlamaCosts::Kind kind) {
  switch (kind) {
    case LlamaCosts::Kind::kEstimated: return "estimated";
    case LlamaCosts::Kind::kFitted: return "fitted";
    case LlamaCosts::Kind::kFlopShares: return "flop_shares";
  }
  return "?";
}

LlamaCosts LlamaCosts::carried(const llm::LlamaConfig& from, int64_t from_seq, int64_t from_mbs,
                               const llm::LlamaConfig& to, int64_t to_seq, int64_t to_mbs) const {
  TWOBP_CHECK(from_seq > 0 && from_mbs > 0 && to_seq > 0 && to_mbs > 0, UsageError,
              "LlamaCosts::carried: sequence lengths and micro-batch sizes must be positive (from {} x {}, to {} x {})",
              from_mbs, from_seq, to_mbs, to_seq);
  LlamaCosts out = *this;
  for (ChunkCost* k : {&out.forward, &out.backward_input, &out.backward_weight, &out.backward}) {
    *k = carried_cost(*k, from, from_seq, from_mbs, to, to_seq, to_mbs);
  }
  return out;
}

CostModel LlamaCosts::cost_model(const llm::Partition& partition, BackwardMode mode, bool recompute,
                                 double communication_ms) const {
  CostModel costs;
  costs.communication = communication_ms;
  costs.overlap = overlap;
  for (const llm::ChunkSpec& chunk : partition.chunks) {
    auto cost = [&](const ChunkCost& k) { return std::max(1e-9, k.of(chunk)); };
    const double f = cost(forward);
    costs.forward.push_back(f);
    costs.backward_input.push_back(mode == BackwardMode::kSplit ? cost(backward_input) : 0.0);
    costs.backward_weight.push_back(mode == BackwardMode::kSplit ? cost(backward_weight) : 0.0);
    costs.backward.push_back(cost(backward));
    if (recompute) costs.recompute.push_back(f);
    if (mode == BackwardMode::kSplit && !backward_weight_fixed.is_zero()) {
      costs.backward_weight_fixed.push_back(std::max(0.0, backward_weight_fixed.of(chunk)));
    }
  }
  return costs;
}

BackwardRatios measured_backward_ratios() {
  return backward_ratios(31.86, 40.49, 22.05, 62.69, "measured on one 7B stage, H200, bf16, seq 4096 (docs/GPU.md)");
}

BackwardRatios flop_backward_ratios() { return BackwardRatios{}; }

BackwardRatios backward_ratios(double forward_ms, double input_ms, double weight_ms, double fused_ms,
                               std::string source) {
  TWOBP_CHECK(forward_ms > 0 && input_ms > 0 && weight_ms > 0 && fused_ms > 0, UsageError,
              "backward_ratios ({}): F, I, W and B must be positive times (got {}, {}, {}, {} ms)", source, forward_ms,
              input_ms, weight_ms, fused_ms);
  return {input_ms / forward_ms, weight_ms / forward_ms, fused_ms / forward_ms, std::move(source)};
}

LlamaCosts estimate_llama_costs(const llm::LlamaConfig& config, int64_t seq, int64_t micro_batch_size,
                                double tflops, const BackwardRatios& ratios, double per_action_ms) {
  TWOBP_CHECK(tflops > 0 && seq > 0 && micro_batch_size > 0, UsageError,
              "estimate_llama_costs: TFLOP/s, sequence length and micro-batch size must be positive (got {}, {}, {})",
              tflops, seq, micro_batch_size);
  TWOBP_CHECK(ratios.input > 0 && ratios.weight > 0 && ratios.fused > 0, UsageError,
              "estimate_llama_costs: the backward ratios ({}) must be positive (got I/F {}, W/F {}, B/F {})",
              ratios.source, ratios.input, ratios.weight, ratios.fused);
  LlamaCosts c;
  c.kind = LlamaCosts::Kind::kEstimated;
  c.forward = flop_shares(config, seq,
                          llm::block_forward_flops(config, seq) * static_cast<double>(micro_batch_size) * 1e3 /
                              (tflops * 1e12));
  c.backward_input = c.forward.scaled(ratios.input);
  c.backward_weight = c.forward.scaled(ratios.weight);
  c.backward = c.forward.scaled(ratios.fused);
  detail::check_cost(per_action_ms, "estimate_llama_costs", "per_action_ms", detail::kMaxCostMs, "time in ms");
  set_per_action(c, per_action_ms);
  c.how = fmt::format("{} TFLOP/s per device, I = {:.3g} F, W = {:.3g} F, B = {:.3g} F ({}){}", tflops, ratios.input,
                      ratios.weight, ratios.fused, ratios.source,
                      per_action_ms > 0 ? fmt::format(", + {:g} ms per action", per_action_ms) : "");
  return c;
}

LlamaCosts fit_llama_costs(const llm::LlamaConfig& config, int64_t seq, const std::vector<MeasuredLlamaRun>& runs,
                           std::optional<double> per_action_ms) {
  if (per_action_ms) {
    detail::check_cost(*per_action_ms, "fit_llama_costs", "per_action_ms", detail::kMaxCostMs, "time in ms");
  }
  Samples F, I, W, W0, B;
  double f_split = 0, f_standard = 0;  // F summed over the 2BP and over the standard runs (for the ratios)
  std::size_t n_split = 0;             // chunks of the 2BP runs (each an F, an I and a W)
  double f_units = 0;                  // Σ partition cost (blocks + head share) of the chunks behind F
  bool any_split = false;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const MeasuredLlamaRun& run = runs[r];
    const std::size_t n = run.partition.chunks.size();
    const MeasuredCosts& c = run.costs;
    TWOBP_CHECK(c.forward.size() == n && c.backward_input.size() == n && c.backward_weight.size() == n &&
                    c.backward.size() == n && run.partition.cost.size() == n,
                UsageError,
                "fit_llama_costs: run {} has {} chunks but costs of {} stages (F), {} (I), {} (W), {} (B): one "
                "entry per chunk of its partition",
                r, n, c.forward.size(), c.backward_input.size(), c.backward_weight.size(), c.backward.size());
    const double f_before = F.total();
    for (std::size_t s = 0; s < n; ++s) {
      const llm::ChunkSpec& chunk = run.partition.chunks[s];
      F.add(chunk, c.forward[s]);
      f_units += run.partition.cost[s];
      if (run.mode == BackwardMode::kSplit) {
        I.add(chunk, c.backward_input[s]);
        W.add(chunk, c.backward_weight[s]);
        W0.add(chunk, c.backward_weight_fixed.size() == n ? c.backward_weight_fixed[s] : 0.0);
      } else {
        B.add(chunk, c.backward[s]);
      }
    }
    (run.mode == BackwardMode::kSplit ? f_split : f_standard) += F.total() - f_before;
    if (run.mode == BackwardMode::kSplit) n_split += n;
    any_split = any_split || run.mode == BackwardMode::kSplit;
  }
  TWOBP_CHECK(any_split, UsageError,
              "fit_llama_costs: no 2BP run among {} (I and W need one: measure with --mode both)", runs.size());
  TWOBP_CHECK(F.total() > 0, UsageError, "fit_llama_costs: the runs have no forward costs");
  LlamaCosts out;
  if (auto f = F.fit(), i = I.fit(), w = W.fit(); f && i && w) {
    // One fact per term: these shapes measure the per-action terms, which a given cost would contradict.
    TWOBP_CHECK(!per_action_ms, UsageError,
                "fit_llama_costs: the runs' chunk shapes determine the per-action terms themselves (F {:.4g}, I "
                "{:.4g}, W {:.4g} ms): a given per-action cost ({:g} ms) would be a second value for them; leave it "
                "out",
                f->per_action, i->per_action, w->per_action, per_action_ms.value_or(0.0));
    out.kind = LlamaCosts::Kind::kFitted;
    out.forward = *f;
    out.backward_input = *i;
    out.backward_weight = *w;
    if (W0.total() != 0) out.backward_weight_fixed = W0.fit().value();  // the same rows as W's
    const std::optional<ChunkCost> b = B.fit();
    out.backward = b ? *b : *i + out.backward_weight_fixed + *w;  // CostModel::unfused_backward, per term
    // Noise can make a fitted term negative; cost_model clamps every chunk's cost at 0, but say so.
    warn_negative("F", out.forward, out.warnings);
    warn_negative("I", out.backward_input, out.warnings);
    warn_negative("W", out.backward_weight, out.warnings);
    warn_negative("W0", out.backward_weight_fixed, out.warnings);
    warn_negative("B", out.backward, out.warnings);
    out.how = fmt::format("fitted per chunk: F {}; I {}; W {}{}; B {}", out.forward.str(), out.backward_input.str(),
                          out.backward_weight.str(),
                          W0.total() != 0 ? fmt::format(" per micro-batch + {} per W", out.backward_weight_fixed.str())
                                          : "",
                          out.backward.str());
    return with_overlap(std::move(out), runs);
  }
  out.kind = LlamaCosts::Kind::kFlopShares;
  // A given per-action cost x: every measured action held it once, so the shares spread what is left, the
  // actions' work (Σ cost - x per action), and x is each action's intercept (set_per_action). Without one, 0.
  const double x = per_action_ms.value_or(0.0);
  const std::size_t n_f = F.ms.size(), n_b = B.ms.size();
  const bool measured_w0 = W0.total() != 0;  // x belongs to W's fixed part: taken from W0, or from W without one
  auto work = [&](const char* what, double total, std::size_t actions) {
    const double left = total - x * static_cast<double>(actions);
    TWOBP_CHECK(actions == 0 || left > 0 || (left == 0 && total == 0), UsageError,
                "fit_llama_costs: a per-action cost of {:g} ms is at least the measured {} of the chunks ({:.4g} ms "
                "over {} actions): no time would be left for their work",
                x, what, total, actions);
    return std::max(0.0, left);
  };
  const double f_work = work("F", F.total(), n_f);
  const double f_split_work = work("F of the 2BP runs", f_split, n_split);
  const double f_standard_work = work("F of the standard runs", f_standard, n_f - n_split);
  const double i_work = work("I", I.total(), n_split);
  const double w_work = measured_w0 ? W.total() : work("W", W.total(), n_split);
  const double w0_work = measured_w0 ? work("W0", W0.total(), n_split) : 0.0;
  const double b_work = work("B", B.total(), n_b);
  out.forward = flop_shares(config, seq, f_work / f_units);
  const double ratio_i = i_work / f_split_work, ratio_w = w_work / f_split_work, ratio_w0 = w0_work / f_split_work;
  out.backward_input = out.forward.scaled(ratio_i);
  out.backward_weight = out.forward.scaled(ratio_w);
  out.backward_weight_fixed = out.forward.scaled(ratio_w0);
  out.backward =
      out.forward.scaled(b_work > 0 && f_standard_work > 0 ? b_work / f_standard_work : ratio_i + ratio_w0 + ratio_w);
  if (per_action_ms) set_per_action(out, x);
  out.how = fmt::format("FLOP shares (one chunk shape: measure a v = 2 schedule too to fit per-action and head "
                        "costs): {:.3g} ms per block, I/F {:.3f}, W/F {:.3f}{}, B/F {:.3f}{}",
                        out.forward.per_block, ratio_i, ratio_w,
                        ratio_w0 != 0 ? fmt::format(" per micro-batch + {:.3f} per W", ratio_w0) : "",
                        out.backward.per_block / out.forward.per_block,
                        per_action_ms ? fmt::format(", + {:g} ms per action (given)", x) : "");
  return with_overlap(std::move(out), runs);
}

llm::LlamaConfig measured_llama_config(const RunDocument& doc, const std::string& where) {
  TWOBP_CHECK(!doc.model.model.empty(), UsageError, "{}: no \"config\" (the measured model's sizes)", where);
  TWOBP_CHECK(doc.model.model == "llama", UsageError,
              "{}: the planner models LLaMa-like stacks; this benchmark ran --model {}", where, doc.model.model);
  llm::LlamaConfig c;
  c.name = "measured";
  c.dim = doc.model.dim;
  c.n_layers = static_cast<int>(doc.model.layers);
  c.n_heads = static_cast<int>(doc.model.heads);
  c.n_kv_heads = static_cast<int>(doc.model.kv_heads);
  c.ffn_dim = doc.model.ffn;
  c.vocab_size = doc.model.vocab;
  c.max_seq_len = doc.model.seq;
  c.validate();
  return c;
}

DocumentCosts fit_run_document(const RunDocument& doc, const std::string& where, const llm::LlamaConfig& to,
                               int64_t to_seq, int64_t to_micro_batch_size, std::optional<double> per_action_ms) {
  const llm::LlamaConfig c = measured_llama_config(doc, where);
  const int64_t seq = doc.model.seq, mbs = doc.model.micro_batch_size;
  std::vector<MeasuredLlamaRun> runs;
  DocumentCosts out;
  double comm_ms = -1;
  for (const RunRecord& r : doc.results) {
    if (!r.plain()) continue;
    for (BackwardMode mode : measured_modes(r)) {
      runs.push_back({llm::make_partition(c, r.p * r.v, seq, r.partition), mode, r.costs});
    }
    if (r.mode == BackwardMode::kSplit && comm_ms < 0) comm_ms = r.costs.communication;
    out.used.push_back(fmt::format("{} {} p={} v={}", r.schedule, to_string(r.mode), r.p, r.v));
  }
  TWOBP_CHECK(comm_ms >= 0, UsageError, "{}: no 2bp result (run `twobp_bench pipeline --mode both`)", where);
  out.costs = fit_llama_costs(c, seq, runs, per_action_ms).carried(c, seq, mbs, to, to_seq, to_micro_batch_size);
  out.comm_ms_per_byte = comm_ms / static_cast<double>(mbs * seq * c.dim * 4);
  return out;
}

LayoutPlan plan_llama_layouts(const llm::LlamaConfig& config, const LlamaCosts& costs, const LayoutPlanOptions& o) {
  TWOBP_CHECK(o.ranks >= 1 && o.micro_batch_size >= 1 && o.seq >= 1 && o.global_batch >= 1, UsageError,
              "plan_llama_layouts: ranks, micro-batch size, sequence length and global batch must be >= 1 (got {}, "
              "{}, {}, {})",
              o.ranks, o.micro_batch_size, o.seq, o.global_batch);
  TWOBP_CHECK(!o.modes.empty() && !o.recompute.empty(), UsageError,
              "plan_llama_layouts: no mode or no recomputation setting to consider");
  const std::string where = "plan_llama_layouts";
  detail::check_cost(o.communication_ms, where, "LayoutPlanOptions.communication_ms", detail::kMaxCostMs, "time in ms");
  detail::check_cost(o.link_latency_s, where, "LayoutPlanOptions.link_latency_s");
  detail::check_cost(o.link_bytes_per_s, where, "LayoutPlanOptions.link_bytes_per_s", detail::kNoBound,
                     "bandwidth in bytes/s (0: none)");
  TWOBP_CHECK(!std::isnan(o.memory_limit_bytes), UsageError,
              "plan_llama_layouts: LayoutPlanOptions.memory_limit_bytes is nan, expected a size in bytes (0: none)");
  const std::vector<std::string> names = o.schedules.empty() ? schedule_names() : o.schedules;
  const int max_dp = o.max_dp > 0 ? std::min(o.max_dp, o.ranks) : o.ranks;
  LayoutPlan plan;
  for (int dp = 1; dp <= max_dp; ++dp) {
    if (o.ranks % dp != 0 || o.global_batch % (dp * o.micro_batch_size) != 0) continue;
    TWOBP_CHECK(dp == 1 || o.link_bytes_per_s > 0, UsageError,
                "plan_llama_layouts: dp = {} needs the all-reduce bandwidth (LayoutPlanOptions::link_bytes_per_s)",
                dp);
    const int pp = o.ranks / dp;
    const int m = static_cast<int>(o.global_batch / (dp * o.micro_batch_size));
    for (const std::string& name : names) {
      for (BackwardMode mode : o.modes) {
        Schedule schedule;
        llm::Partition partition;
        try {
          // synth is synthesized for these costs: its partition follows its stages, as the others' does.
          schedule = make_schedule_for_costs(
              name, default_schedule_options(name, pp, m, mode), [&](const std::vector<int>& stage_to_rank) {
                return costs.cost_model(llm::make_partition(config, static_cast<int>(stage_to_rank.size()), o.seq),
                                        mode, false, o.communication_ms);
              },
              o.synthesis);
          partition = llm::make_partition(config, schedule.num_stages, o.seq);
        } catch (const UsageError&) {  // ScheduleError too
          ++plan.skipped;  // a shape this schedule or the model's layer count does not allow
          continue;
        }
        // Several chunks on the only rank interleave nothing: the same work in more actions (measured slower).
        if (pp == 1 && schedule.num_stages > 1) {
          ++plan.skipped;
          continue;
        }
        for (bool recompute : o.recompute) {
          if (!recompute) {
            plan.candidates.push_back(predict(config, costs, o, schedule, partition, dp, {}));
            continue;
          }
          // Each rank's peak without recomputation orders the ranks that take it up (recompute_order).
          std::vector<double> peaks;
          for (const auto& e : llm::estimate_memory(config, partition, schedule, memory_options(o, {}))) {
            peaks.push_back(e.total);
          }
          const std::vector<int> order = recompute_order(peaks, pp);
          for (int j = 1; j <= pp; ++j) {
            plan.candidates.push_back(predict(config, costs, o, schedule, partition, dp, first_ranks_of(order, j)));
          }
        }
      }
    }
  }
  TWOBP_CHECK(!plan.candidates.empty(), UsageError,
              "no candidate: no dp divides {} ranks with the global batch {} (micro-batch size {}), or every schedule "
              "rejected its shape",
              o.ranks, o.global_batch, o.micro_batch_size);
  std::stable_sort(plan.candidates.begin(), plan.candidates.end(),
                   [](const LayoutCandidate& x, const LayoutCandidate& y) {
                     if (x.fits != y.fits) return x.fits;
                     if (x.tokens_per_s != y.tokens_per_s) return x.tokens_per_s > y.tokens_per_s;
                     return x.peak_memory < y.peak_memory;
                   });
  return plan;
}

}  // namespace twobp
