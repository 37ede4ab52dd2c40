// What every rank of llama_pipeline agrees on before the first step, the dry run and the memory check.
#include <algorithm>

#include <unistd.h>  // sysconf: the machine's memory

#include "example.h"
#include "twobp/error.h"
#include "twobp/plan/llama_memory.h"
#include "twobp/schedule/registry.h"
#include "twobp_cli.h"

namespace llama_example {
namespace {

/// The layout a checkpoint of `p` is written with (recorded, not checked).
ck::CheckpointConfig checkpoint_layout(const Plan& p) {
  return {{"stages", std::to_string(p.schedule.num_stages)},
          {"world_size", std::to_string(p.world_size)},
          {"schedule", p.schedule.name},
          {"partition", p.partition.layout()}};
}

/// The model and the default sequence length: a Hugging Face config.json (--init-from's, or the one a checkpoint of
/// such a run carries, for --resume) or a preset with --dim ... --vocab.
void set_model(Plan& plan, const Args& args) {
  plan.hf_config = !args.init_from.empty() ? read_hf_config_text(args.init_from)
                   : args.resume           ? checkpoint_hf_config(args.checkpoint_dir)
                                           : std::string();
  if (plan.hf_config.empty()) {
    plan.config = llm::with_dims(llm::config_by_name(args.model), args.dims);
    plan.seq_len = args.seq_len > 0 ? args.seq_len : plan.config.max_seq_len;
    return;
  }
  const std::string source = !args.init_from.empty()
                                 ? args.init_from + "/config.json"
                                 : fmt::format("{}/manifest.json's {}", args.checkpoint_dir, kHfConfigKey);
  plan.config = hf_model_config(args, plan.hf_config, source);
  plan.seq_len = args.seq_len > 0 ? args.seq_len : std::min<int64_t>(plan.config.max_seq_len, kHfDefaultSeqLen);
}

}  // namespace

Plan make_plan(const Args& args, int world_size) {
  Plan plan;
  plan.args = args;
  plan.world_size = world_size;
  plan.dp = args.dp;
  set_model(plan, args);
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
  plan.checkpoint_layout = checkpoint_layout(plan);
  if (!plan.hf_config.empty()) {  // the model is its config.json, wherever the directory was (config.name names it)
    plan.checkpoint_config["model"] = "hf-llama";
    plan.checkpoint_config[kHfConfigKey] = plan.hf_config;
  } else if (args.dims.any()) {  // a custom model: its sizes are part of what a checkpoint belongs to
    const auto& c = plan.config;
    plan.checkpoint_config["sizes"] = fmt::format("dim {} layers {} heads {} kv_heads {} ffn {} vocab {}", c.dim,
                                                  c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size);
  }
  return plan;
}

twobp::Placement placement_of(const Plan& p) { return {p.schedule, p.partition, p.recompute_ranks}; }

Plan with_placement(const Plan& p, const twobp::Placement& to) {
  Plan out = p;
  out.schedule = to.schedule;
  out.partition = to.partition;
  out.recompute_ranks = to.recompute_ranks;
  out.checkpoint_layout = checkpoint_layout(out);
  return out;
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
          {"nccl_stream_waits", a.nccl_stream_waits},
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
  mo.optimizer_shards = p.args.zero >= 1 ? p.dp : 1;
  mo.gradient_shards = p.args.zero == 2 ? p.dp : 1;
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
  EXAMPLE_CHECK(need <= 1.25 * host, twobp::UsageError,
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
  const twobp::LlamaMemoryReport report = twobp::llama_memory_report(
      p.config, p.partition, p.schedule, memory_options(p), p.args.gpu_memory_gb * 1024.0 * 1024.0 * 1024.0);
  for (const std::string& line : report.lines) fmt::print("{}\n", line);
  nlohmann::json j = config_json(p);
  j.update(nlohmann::json::parse(report.json));
  if (!p.args.json.empty()) twobp::cli::write_json(p.args.json, j);
  return 0;
}

}  // namespace llama_example
