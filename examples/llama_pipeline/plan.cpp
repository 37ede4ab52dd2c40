// What every rank of llama_pipeline agrees on before the first step, the dry run and the memory check.
#include <algorithm>
#include <cmath>
#include <fstream>

#include <unistd.h>  // sysconf: the machine's memory

#include "example.h"
#include "twobp/error.h"
#include "twobp/plan/llama.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"

namespace llama_example {

Plan make_plan(const Args& args, int world_size) {
  Plan plan;
  plan.args = args;
  plan.world_size = world_size;
  plan.dp = args.dp;
  plan.config = llm::with_dims(llm::config_by_name(args.model), args.dims);
  plan.seq_len = args.seq_len > 0 ? args.seq_len : plan.config.max_seq_len;
  // --schedule auto starts with --auto-start; twobp::AutoSchedule switches at a step boundary (train.cpp).
  const std::string first = args.auto_schedule() ? args.auto_start : args.schedule;
  plan.schedule = twobp::resolve_schedule({first, args.schedule_file, args.chunks_per_rank}, world_size,
                                          args.microbatches,
                                          args.two_bp ? twobp::BackwardMode::kSplit : twobp::BackwardMode::kStandard);
  plan.partition = llm::make_partition(plan.config, plan.schedule.num_stages, plan.seq_len, args.partition);
  plan.recompute_ranks =
      twobp::recomputing_ranks(args.recompute, args.recompute_ranks, args.recompute_on, plan.schedule.num_ranks);
  plan.precision = twobp::parse_precision(args.dtype);
  plan.checkpoint_config = {{"model", plan.config.name}, {"dtype", args.dtype}, {"seed", std::to_string(args.seed)}};
  plan.checkpoint_layout = {{"stages", std::to_string(plan.schedule.num_stages)},
                            {"world_size", std::to_string(world_size)},
                            {"schedule", plan.schedule.name},
                            {"partition", plan.partition.layout()}};
  if (args.dims.any()) {  // a custom model: its sizes are part of what a checkpoint belongs to
    const auto& c = plan.config;
    plan.checkpoint_config["sizes"] = fmt::format("dim {} layers {} heads {} kv_heads {} ffn {} vocab {}", c.dim,
                                                  c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size);
  }
  return plan;
}

bool same_placement(const Plan& a, const Plan& b) {
  return a.schedule.num_stages == b.schedule.num_stages && a.schedule.stage_to_rank == b.schedule.stage_to_rank &&
         a.partition.layout() == b.partition.layout();
}

PlacementRanking rank_placements(const Plan& current, const twobp::MeasuredCosts& measured, double communication_ms) {
  const Args& a = current.args;
  PlacementRanking out;
  auto every_stage = [](const std::vector<double>& ms) {
    return !ms.empty() && std::all_of(ms.begin(), ms.end(), [](double x) { return x > 0; });
  };
  if (!every_stage(measured.forward) || !every_stage(measured.backward_input) ||
      !every_stage(measured.backward_weight)) {
    out.why_none = "the probes did not measure F, I and W on every stage (a 2BP form that runs them all)";
    return out;
  }
  // The run's chunks: I and W from its 2BP probe, B from its standard one where that ran (fit_llama_costs).
  std::vector<twobp::MeasuredLlamaRun> runs{{current.partition, twobp::BackwardMode::kSplit, measured}};
  if (every_stage(measured.backward)) runs.push_back({current.partition, twobp::BackwardMode::kStandard, measured});
  const twobp::LlamaCosts costs = twobp::fit_llama_costs(current.config, current.seq_len, runs);
  // One replica's view (its ranks, its micro-batches): the data-parallel reduction differs little between
  // placements of the same parameters, and the measurement decides anyway.
  twobp::LayoutPlanOptions o;
  o.ranks = current.world_size;
  o.max_dp = 1;
  o.seq = current.seq_len;
  o.micro_batch_size = a.micro_batch_size;
  o.global_batch = static_cast<int64_t>(a.microbatches) * a.micro_batch_size;
  o.recompute = a.auto_recompute ? std::vector<bool>{false, true} : std::vector<bool>{false};
  o.precision = llm::training_precision(current.precision);
  o.memory_limit_bytes = a.auto_memory_limit_gb * 1024.0 * 1024.0 * 1024.0;
  o.communication_ms = communication_ms;
  twobp::LayoutPlan plan;
  try {
    plan = twobp::plan_llama_layouts(current.config, costs, o);
  } catch (const twobp::UsageError& e) {
    out.why_none = e.what();
    return out;
  }
  const twobp::BackwardMode mode = current.schedule.backward;
  for (const twobp::LayoutCandidate& c : plan.candidates) {
    if (!c.fits) continue;
    Args b = a;
    b.auto_start = c.schedule;
    b.chunks_per_rank = c.v;
    b.two_bp = c.mode == twobp::BackwardMode::kSplit;
    b.partition.clear();  // balanced (make_partition), as the planner cut it
    Plan other = make_plan(b, current.world_size);
    other.recompute_ranks = c.recompute_ranks;
    if (!same_placement(other, current)) {
      out.others.push_back({std::move(other), c.step_ms});
    } else if (c.schedule == current.schedule.name && c.mode == mode && c.recompute_ranks == current.recompute_ranks) {
      out.current_ms = c.step_ms;
    }
  }
  if (out.current_ms == 0) {  // not among the planner's forms (a --partition of its own): simulated directly
    out.current_ms = twobp::simulate(current.schedule, costs.cost_model(current.partition, mode,
                                                                        !current.recompute_ranks.empty(),
                                                                        communication_ms))
                         .step_time;
  }
  std::stable_sort(out.others.begin(), out.others.end(), [](const PlacementCandidate& x, const PlacementCandidate& y) {
    return x.predicted_ms < y.predicted_ms;
  });
  out.fit = costs.how;
  if (out.others.empty()) {
    out.why_none = "no other placement of these ranks and micro-batches fits";
    if (o.memory_limit_bytes > 0) {
      out.why_none +=
          fmt::format(" within {} per rank (the planner's memory estimate)", human_bytes(o.memory_limit_bytes));
    }
  }
  return out;
}

std::string describe_placement(const Plan& p) {
  std::string s = fmt::format("{} {} ({} chunk(s) per rank, layers {})", p.schedule.name,
                              twobp::to_string(p.schedule.backward),
                              p.schedule.num_stages / p.world_size, p.partition.layout());
  if (!p.recompute_ranks.empty()) s += fmt::format(" recomputing on ranks {}", fmt::join(p.recompute_ranks, ","));
  return s;
}

double learning_rate(const Args& a, int step) {
  const int warmup = a.warmup_steps >= 0 ? a.warmup_steps : a.steps / 10;
  if (step < warmup) return a.lr * (step + 1) / static_cast<double>(warmup);
  const double progress = std::min(1.0, (step - warmup) / static_cast<double>(std::max(1, a.steps - warmup)));
  const double min_ratio = 0.1;
  return a.lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", b, units[u]);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  out.close();
  if (!out.good()) throw twobp::IOError(fmt::format("cannot write JSON output {}", path));
}

nlohmann::json config_json(const Plan& p) {
  const Args& a = p.args;
  return {{"model", p.config.name},
          {"dim", p.config.dim},
          {"layers", p.config.n_layers},
          {"heads", p.config.n_heads},
          {"kv_heads", p.config.n_kv_heads},
          {"ffn", p.config.ffn_dim},
          {"vocab", p.config.vocab_size},
          {"schedule", p.schedule.name},
          {"schedule_file", a.schedule_file},
          {"auto_schedule", a.auto_schedule()},  // then "schedule" is the one it started with
          {"2bp", p.schedule.backward == twobp::BackwardMode::kSplit},
          {"world_size", p.dp * p.world_size},
          {"dp", p.dp},
          {"pp", p.world_size},
          {"num_stages", p.schedule.num_stages},
          {"chunks_per_rank", p.schedule.num_stages / p.world_size},
          {"partition", p.partition.layout()},
          {"microbatches", a.microbatches},
          {"micro_batch_size", a.micro_batch_size},
          {"seq_len", p.seq_len},
          {"lr", a.lr},
          {"dtype", a.dtype},
          {"device", a.device},
          {"seed", a.seed},
          {"parameters", llm::parameter_count(p.config)}};
}

// ---- Dry run and memory: sizes and memory from formulas; nothing is allocated ----

/// What the memory formulas need to know of the run (twobp::models::estimate_memory).
llm::MemoryPlanOptions memory_options(const Plan& p) {
  llm::MemoryPlanOptions mo;
  mo.micro_batch_size = p.args.micro_batch_size;
  mo.seq_len = p.seq_len;
  mo.precision = llm::training_precision(p.precision);
  mo.recompute = !p.recompute_ranks.empty();
  mo.recompute_ranks = p.recompute_ranks;
  mo.optimizer_shards = p.args.zero == 1 ? p.dp : 1;
  return mo;
}

/// A CPU run that clearly cannot fit: the estimated peak of this process's ranks (every rank of the job when they
/// are threads) against the machine's memory, refused before anything is allocated instead of failing in the
/// allocator (or swapping) part-way through. Only clear cases: the estimate must exceed the memory by more than
/// its own margin (25 %; tests/models/llama_memory_test.cpp holds the formulas within 20 % of a Stage's tensors),
/// and under --max-pending-w or --memory-limit-gb the deferred W's are not counted (those bound them).
void check_fits_in_host_memory(const Plan& p, bool ranks_are_threads, int my_pipeline_rank) {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return;  // unknown: nothing to compare with
  const double host = static_cast<double>(pages) * static_cast<double>(page_size);
  const auto ranks = llm::estimate_memory(p.config, p.partition, p.schedule, memory_options(p));
  const bool bounded_w = p.args.max_pending_w > 0 || p.args.memory_limit_gb > 0;
  double need = 0;
  for (int r = 0; r < p.world_size; ++r) {
    if (!ranks_are_threads && r != my_pipeline_rank) continue;
    need += (ranks[r].total - (bounded_w ? ranks[r].pending_weights : 0.0)) * (ranks_are_threads ? p.dp : 1);
  }
  const double gib = 1024.0 * 1024.0 * 1024.0;
  TWOBP_CHECK(need <= 1.25 * host, twobp::UsageError,
              "model {} ({} parameters), {} micro-batches of {} x {} tokens: an estimated {:.1f} GiB in this "
              "process{} (weights, gradients, AdamW state, activations{}: twobp::models::estimate_memory), far more "
              "than this machine's {:.1f} GiB; use a smaller --model/--dim/--layers, --micro-batch-size, --seq-len "
              "or --microbatches{} (--dry-run prints the estimate per rank)",
              p.config.name, llm::parameter_count(p.config), p.schedule.num_micro_batches, p.args.micro_batch_size,
              p.seq_len, need / gib,
              ranks_are_threads ? fmt::format(" ({} ranks as threads)", p.world_size * p.dp) : "",
              bounded_w ? "" : ", deferred W's", host / gib,
              p.schedule.backward == twobp::BackwardMode::kSplit && !bounded_w
                  ? ", or bound 2BP's deferred W's with --max-pending-w or --memory-limit-gb" : "");
}

int dry_run(const Plan& p) {
  const auto& cfg = p.config;
  const int S = p.schedule.num_stages;
  // Simulated schedule with the partition's compute estimates (I and W each ~ one forward; B = I + W).
  twobp::CostModel costs;
  for (int s = 0; s < S; ++s) {
    const double c = std::max(0.05, p.partition.cost[s]);
    costs.forward.push_back(c);
    costs.backward_input.push_back(c);
    costs.backward_weight.push_back(c);
    costs.backward.push_back(2 * c);
  }
  const auto sim = twobp::simulate(p.schedule, costs);
  // Memory: the formulas of twobp::models::memory_model walked through the schedule by
  // twobp::simulate_peak_memory, as twobp_bench pipeline does with measured memory.
  const llm::MemoryPlanOptions mo = memory_options(p);
  const auto ranks = llm::estimate_memory(cfg, p.partition, p.schedule, mo);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double budget = p.args.gpu_memory_gb * gib;

  nlohmann::json j = config_json(p);
  j["parameters"] = llm::parameter_count(cfg);
  j["simulated_bubble_fraction"] = sim.bubble_fraction;
  j["precision"] = twobp::to_string(p.precision);
  j["recompute"] = mo.recompute;
  const bool every_rank = static_cast<int>(mo.recompute_ranks.size()) == p.world_size;
  if (mo.recompute && !every_rank) j["recompute_ranks"] = mo.recompute_ranks;
  if (budget > 0) j["gpu_memory_gb"] = p.args.gpu_memory_gb;
  j["memory_formula"] =
      "twobp::models::memory_model + twobp::simulate_peak_memory: base = parameters x (compute + master + AdamW "
      "bytes); per stage F keeps chunk_activation_bytes (recompute: the input), I keeps chunk_pending_weight_bytes "
      "until W, the first W or B allocates the gradients; message buffers not counted";
  const std::string recompute_note = !mo.recompute ? ""
                                     : every_rank  ? ", recompute"
                                                   : fmt::format(", recompute on rank{} {}",
                                                                 mo.recompute_ranks.size() > 1 ? "s" : "",
                                                                 twobp::format_ranks(mo.recompute_ranks));
  fmt::print("model {}: {} parameters ({:.3f} B), {} stages over {} ranks, schedule {} ({}), partition {} "
             "(imbalance {:.3f}), precision {}{}, micro-batch {} x {} tokens, m = {}\n",
             cfg.name, llm::parameter_count(cfg), llm::parameter_count(cfg) / 1e9, S, p.world_size, p.schedule.name,
             twobp::to_string(p.schedule.backward), p.partition.layout(),
             p.partition.imbalance(), twobp::to_string(p.precision), recompute_note, mo.micro_batch_size, mo.seq_len,
             p.schedule.num_micro_batches);
  j["stages"] = nlohmann::json::array();
  for (int s = 0; s < S; ++s) {
    const auto& spec = p.partition.chunks[s];
    const int64_t b = mo.precision.compute_bytes;
    j["stages"].push_back(
        {{"stage", s},
         {"rank", p.schedule.stage_to_rank[s]},
         {"first_layer", spec.first_layer},
         {"end_layer", spec.end_layer},
         {"embedding", spec.has_embedding},
         {"head", spec.has_head},
         {"parameters", llm::chunk_parameter_count(cfg, spec)},
         {"cost", p.partition.cost[s]},
         {"activation_bytes_per_micro_batch",
          llm::chunk_activation_bytes(cfg, spec, mo.micro_batch_size, mo.seq_len, b)},
         {"pending_weight_bytes_per_micro_batch",
          llm::chunk_pending_weight_bytes(cfg, spec, mo.micro_batch_size, mo.seq_len, b)}});
  }
  j["ranks"] = nlohmann::json::array();
  bool all_fit = true;
  for (int r = 0; r < p.world_size; ++r) {
    const auto& e = ranks[r];
    const bool fits = budget <= 0 || e.total <= budget;
    all_fit = all_fit && fits;
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
    if (budget > 0) row["fits"] = fits;
    j["ranks"].push_back(row);
    fmt::print("  rank {}: stages {}, {} parameters | weights {}, masters {}, AdamW {}, grads {} | activations {}, "
               "pending W {} | total {}{}\n",
               r, fmt::join(p.schedule.stages_of(r), ","), e.parameters, human_bytes(e.weights),
               human_bytes(e.master_weights), human_bytes(e.optimizer), human_bytes(e.gradients),
               human_bytes(e.activations), human_bytes(e.pending_weights), human_bytes(e.total),
               budget > 0 ? (fits ? fmt::format(" (fits {:g} GiB)", p.args.gpu_memory_gb)
                                  : fmt::format(" (DOES NOT FIT {:g} GiB)", p.args.gpu_memory_gb))
                          : "");
  }
  if (budget > 0) j["fits"] = all_fit;
  if (!p.args.json.empty()) write_json(p.args.json, j);
  return 0;
}

}  // namespace llama_example
