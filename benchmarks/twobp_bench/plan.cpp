// `twobp_bench plan`: which schedule, mode, v, micro-batch count, recomputation and dp x pp layout to run for a
// LLaMa-like model on N ranks, ranked by predicted throughput among the candidates that fit in memory.
//
//   twobp_bench plan --model 7b --ranks 4 --gpu-memory-gb 80 --json plan.json           # estimated costs
//   twobp_bench plan --costs-json pipeline.json --ranks 2 --global-batch 16 --json p.json   # measured costs
//
// The candidates, costs (estimated, or fitted from run documents: twobp/plan/record.h), predictions and ranking
// are library code (twobp/plan/llama.h); docs/BENCHMARKS.md ("plan") describes them. The JSON holds every
// candidate with its prediction, the example command line that runs it and the `twobp_bench pipeline` arguments
// that measure it here (used by the planner check test).

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "twobp/metrics/metrics.h"
#include "twobp/models/llama.h"
#include "twobp/plan/llama.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/record.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp_cli.h"

namespace twobp::bench {
namespace {

namespace llm = twobp::models;

struct PlanArgs {
  std::string model = "7b";
  llm::LlamaDims dims;  // custom sizes (override the preset's or the measured model's when > 0)
  int ranks = 4;
  double gpu_memory_gb = 0;
  int64_t seq = 0;  // 0: the model's max_seq_len
  int64_t micro_batch_size = 1;
  int64_t global_batch = 0;  // sequences per step; 0: 8 · ranks · micro-batch-size
  Precision precision = Precision::kMixedBFloat16;
  bool precision_given = false;  // --dtype (or --precision) given; else measured costs decide (run_plan)
  double tflops = 400;
  std::string ratios_json;  // a `twobp_bench split` JSON: its fast path's I/F, W/F, B/F for estimated costs
  std::vector<std::string> costs_json;  // one or more `twobp_bench pipeline` / `llama_pipeline --costs-json` files
  double overlap = -1;  // < 0: the measured share (0 for estimated costs)
  // --action-ms: every action's fixed cost (ChunkCost::per_action), where the costs do not determine it themselves.
  std::optional<double> action_ms;
  double link_gbps = 100;
  double link_latency_us = 5;
  std::string schedule = "all";
  std::string mode = "both";
  std::string recompute = "both";
  int top = 10;
  int max_dp = 0;  // 0: up to --ranks
  std::string json;
};

// What the actions and messages cost on the planned model.
struct Rates {
  std::string source;
  LlamaCosts costs;
  double comm_ms_per_byte = 0, comm_latency_ms = 0;
  // Where the costs hold: estimated ones for GPUs (--tflops per device); measured ones where `twobp_bench
  // pipeline` ran, on CPU. The suggested command runs there.
  std::string device = "cuda";
};

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

llm::LlamaConfig config_of(const PlanArgs& a, const RunDocument* measured, const std::string& where) {
  // The measured benchmark's own model (twobp_bench pipeline --model llama, or the example's).
  return llm::with_dims(measured ? measured_llama_config(*measured, where) : llm::config_by_name(a.model), a.dims);
}

// Bytes of one activation message (a micro-batch's hidden state) in the compute dtype.
double activation_bytes(const llm::LlamaConfig& c, int64_t mbs, int64_t seq, int64_t bytes) {
  return static_cast<double>(mbs * seq * c.dim * bytes);
}

// Costs measured on the document's own model (`path`: its files; fit_run_document), on CPU.
Rates measured_rates(const RunDocument& doc, const std::string& path, const llm::LlamaConfig& to, int64_t to_seq,
                     int64_t to_mbs, std::optional<double> action_ms) {
  DocumentCosts fit;
  try {
    fit = fit_run_document(doc, path, to, to_seq, to_mbs, action_ms);
  } catch (const UsageError& e) {  // e.g. the files' shapes fit the per-action terms themselves: say the option
    if (!action_ms) throw;
    throw UsageError(fmt::format("--action-ms {:g}: {}", *action_ms, e.what()));
  }
  Rates rates;
  rates.costs = fit.costs;
  rates.comm_ms_per_byte = fit.comm_ms_per_byte;
  rates.source = fmt::format("measured: {} ({}): {}", path, fmt::join(fit.used, ", "), rates.costs.how);
  rates.device = "cpu";
  return rates;
}

// Estimated costs (--tflops) and links (--link-gbps, --link-latency-us).
Rates estimated_rates(const PlanArgs& a, const llm::LlamaConfig& config, int64_t seq) {
  BackwardRatios ratios = measured_backward_ratios();
  if (!a.ratios_json.empty()) {
    const Json split = read_json(a.ratios_json);
    if (!split.contains("fast")) {
      throw std::runtime_error(a.ratios_json + ": no fast path (a `twobp_bench split` JSON?)");
    }
    const Json& fast = split["fast"];
    ratios = backward_ratios(fast.value("forward_ms", 0.0), fast.value("stage1_ms", 0.0),
                             fast.value("stage2_ms", 0.0), fast.value("fused_ms", 0.0), a.ratios_json + " fast path");
  }
  Rates rates;
  rates.costs = estimate_llama_costs(config, seq, a.micro_batch_size, a.tflops, ratios, a.action_ms.value_or(0.0));
  rates.comm_ms_per_byte = 1e3 / (a.link_gbps * 1e9 / 8);
  rates.comm_latency_ms = a.link_latency_us * 1e-3;
  rates.source = fmt::format("estimated: {}, links {} Gb/s + {} us", rates.costs.how, a.link_gbps,
                             a.link_latency_us);
  return rates;
}

// The example's model options for `c`: its preset, or a preset's options and every size (the presets differ
// only in sizes).
std::string example_model(const llm::LlamaConfig& c) {
  for (const auto& name : llm::config_names()) {
    const llm::LlamaConfig preset = llm::config_by_name(name);
    if (preset.dim == c.dim && preset.n_layers == c.n_layers && preset.n_heads == c.n_heads &&
        preset.n_kv_heads == c.n_kv_heads && preset.ffn_dim == c.ffn_dim && preset.vocab_size == c.vocab_size) {
      return "--model " + name;
    }
  }
  return fmt::format("--model {} --dim {} --layers {} --heads {} --kv-heads {} --ffn {} --vocab {}",
                     llm::config_names().front(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim,
                     c.vocab_size);
}

// The command-line options of a recomputation setting, the same for the example and `twobp_bench pipeline`: none,
// --recompute (every rank), --recompute-ranks N (the first N), else --recompute-on with the ranks.
std::vector<std::string> recompute_args(const LayoutCandidate& k) {
  const std::vector<int>& ranks = k.recompute_ranks;
  const int n = static_cast<int>(ranks.size());
  if (n == 0) return {};
  if (n == k.pp) return {"--recompute"};
  if (ranks.back() == n - 1) return {"--recompute", "--recompute-ranks", std::to_string(n)};  // ranks 0 .. n - 1
  return {"--recompute", "--recompute-on", format_ranks(ranks)};
}

std::string recompute_options(const LayoutCandidate& k) {
  std::string out;
  for (const std::string& arg : recompute_args(k)) out += " " + arg;
  return out;
}

std::string example_command(const PlanArgs& a, const llm::LlamaConfig& c, int64_t seq, const LayoutCandidate& k,
                            const std::string& device) {
  return fmt::format("torchrun --nproc-per-node {} --no-python build/examples/llama_pipeline {} --device {} "
                     "--dtype {} --schedule {} --chunks-per-rank {} --microbatches {} --micro-batch-size {} "
                     "--seq-len {}{}{}{}",
                     a.ranks, example_model(c), device, to_string(a.precision), k.schedule, k.v, k.m,
                     a.micro_batch_size, seq, k.dp > 1 ? fmt::format(" --dp {}", k.dp) : "",
                     k.mode == BackwardMode::kSplit ? "" : " --no-2bp", recompute_options(k));
}

// `twobp_bench pipeline` arguments that measure candidate k on this machine (ranks as threads).
std::vector<std::string> bench_args(const llm::LlamaConfig& c, int64_t seq, int64_t mbs, const LayoutCandidate& k) {
  std::vector<std::string> args{"pipeline",
                                "--ranks", std::to_string(k.pp),
                                "--dp", std::to_string(k.dp),
                                "--schedule", k.schedule,
                                "--chunks-per-rank", std::to_string(k.v),
                                "--mode", to_string(k.mode),
                                "--microbatches", std::to_string(k.m),
                                "--micro-batch-size", std::to_string(mbs),
                                "--dim", std::to_string(c.dim),
                                "--layers", std::to_string(c.n_layers),
                                "--heads", std::to_string(c.n_heads),
                                "--kv-heads", std::to_string(c.n_kv_heads),
                                "--ffn", std::to_string(c.ffn_dim),
                                "--vocab", std::to_string(c.vocab_size),
                                "--seq", std::to_string(seq)};
  for (std::string& arg : recompute_args(k)) args.push_back(std::move(arg));
  return args;
}

// One ranked candidate with the commands that run and measure it.
struct PlanRow {
  std::size_t rank = 0;
  const LayoutCandidate* k = nullptr;
  std::string command;
  std::vector<std::string> bench_args;
};

// A candidate's outputs: its JSON object in this order, and the table's columns.
Reporter<PlanRow> plan_reporter() {
  using Row = PlanRow;
  std::vector<Column<Row>> cols;
  auto add = [&](auto&&... args) { cols.push_back(column<Row>(std::forward<decltype(args)>(args)...)); };
  add("rank", [](const Row& r) { return r.rank; }, "#", [](const Row& r) { return std::to_string(r.rank); });
  add("schedule", [](const Row& r) { return r.k->schedule; }, "schedule", [](const Row& r) { return r.k->schedule; });
  add("mode", [](const Row& r) { return to_string(r.k->mode); }, "mode",
      [](const Row& r) { return std::string(to_string(r.k->mode)); });
  add("v", [](const Row& r) { return r.k->v; }, "v", [](const Row& r) { return std::to_string(r.k->v); });
  add("m", [](const Row& r) { return r.k->m; }, "m", [](const Row& r) { return std::to_string(r.k->m); });
  add("recompute_ranks", [](const Row& r) { return r.k->recompute_ranks; }, "recompute", [](const Row& r) {
    const std::vector<int>& ranks = r.k->recompute_ranks;
    const int n = static_cast<int>(ranks.size());
    return n == 0 ? std::string("no") : n == r.k->pp ? std::string("all") : "ranks " + format_ranks(ranks);
  });
  add("dp", [](const Row& r) { return r.k->dp; }, "dp x pp",
      [](const Row& r) { return fmt::format("{} x {}", r.k->dp, r.k->pp); });
  add("pp", [](const Row& r) { return r.k->pp; });
  add("sim_tokens_per_s", [](const Row& r) { return r.k->tokens_per_s; }, "tokens/s",
      [](const Row& r) { return fmt_num(r.k->tokens_per_s, 0); });
  add("sim_step_ms", [](const Row& r) { return r.k->step_ms; }, "step ms",
      [](const Row& r) { return fmt_num(r.k->step_ms, 1); });
  add("sim_bubble_fraction", [](const Row& r) { return r.k->bubble; }, "bubble",
      [](const Row& r) { return fmt_num(r.k->bubble, 3); });
  add("peak_memory_bytes_per_rank", [](const Row& r) { return r.k->memory_per_rank; }, "", nullptr, false);
  add("peak_memory_bytes", [](const Row& r) { return r.k->peak_memory; }, "peak GiB",
      [](const Row& r) { return fmt_num(r.k->peak_memory / kGiB, 2); });
  add("fits", [](const Row& r) { return r.k->fits; }, "fits",
      [](const Row& r) { return std::string(r.k->fits ? "yes" : "no"); });
  add("command", [](const Row& r) { return r.command; });
  add("bench_args", [](const Row& r) { return r.bench_args; }, "", nullptr, false);
  return Reporter<Row>(std::move(cols), {"#", "schedule", "mode", "v", "m", "recompute", "dp x pp", "tokens/s",
                                         "step ms", "bubble", "peak GiB", "fits"});
}

Json cost_terms_json(const ChunkCost& k) {
  return {{"per_action", k.per_action}, {"per_block", k.per_block}, {"embedding", k.embedding}, {"head", k.head}};
}

// What is planned, printed before the search (which takes a while: it synthesizes a schedule per layout).
void print_plan_header(const PlanArgs& a, const llm::LlamaConfig& config, const LayoutPlanOptions& o,
                       const Rates& rates) {
  std::cout << fmt::format("plan: model {} ({:.3g} B parameters), {} ranks, global batch {} x {} tokens, "
                           "precision {}, memory per device {}\n  costs {}\n",
                           config.name, static_cast<double>(llm::parameter_count(config)) / 1e9, a.ranks,
                           o.global_batch, o.seq, to_string(a.precision),
                           a.gpu_memory_gb > 0 ? fmt::format("{:g} GiB", a.gpu_memory_gb) : "not limited",
                           rates.source)
            << std::flush;
}

// Prints the ranked plan (the first --top rows) and the best command; writes --json.
void report_plan(const PlanArgs& a, const llm::LlamaConfig& config, const LayoutPlanOptions& o, const Rates& rates,
                 const LayoutPlan& plan) {
  Json out;
  out["config"] = {{"model", config.name},      {"parameters", llm::parameter_count(config)},
                   {"ranks", a.ranks},          {"seq", o.seq},
                   {"micro_batch_size", a.micro_batch_size}, {"global_batch", o.global_batch},
                   {"precision", to_string(a.precision)}, {"gpu_memory_gb", a.gpu_memory_gb},
                   {"costs", rates.source},     {"skipped_shapes", plan.skipped}};
  // The per-chunk cost terms (ms) the predictions used, on the planned model.
  const LlamaCosts& c = rates.costs;
  out["config"]["cost_model"] = {{"kind", llama_costs_kind_name(c.kind)}, {"F", cost_terms_json(c.forward)},
                                 {"I", cost_terms_json(c.backward_input)}, {"W", cost_terms_json(c.backward_weight)},
                                 {"B", cost_terms_json(c.backward)}};
  if (!c.backward_weight_fixed.is_zero()) out["config"]["cost_model"]["W0"] = cost_terms_json(c.backward_weight_fixed);
  out["config"]["cost_model"]["overlap"] = c.overlap;
  out["config"]["device"] = rates.device;
  if (c.overlap > 0) {
    std::cout << "  note: dualpipev's predictions run its F&B pairs at once; the example commands below run them in "
                 "order (a runtime hook overlaps them: PipelineOptions::executor.overlap_forward_backward)\n";
  }
  out["warnings"] = c.warnings;
  for (const std::string& w : c.warnings) std::cerr << "twobp_bench plan: warning: " << w << "\n";
  const std::vector<LayoutCandidate>& candidates = plan.candidates;
  std::vector<PlanRow> rows;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const LayoutCandidate& k = candidates[i];
    rows.push_back({i + 1, &k, example_command(a, config, o.seq, k, rates.device),
                    bench_args(config, o.seq, a.micro_batch_size, k)});
  }
  const Reporter<PlanRow> reporter = plan_reporter();
  out["candidates"] = Json::array();
  for (const PlanRow& row : rows) out["candidates"].push_back(reporter.json(row));
  print_table(std::cout, reporter.table({rows.begin(), rows.begin() + std::min<std::size_t>(rows.size(), a.top)}));
  if (candidates.size() > static_cast<std::size_t>(a.top)) {
    std::cout << fmt::format("({} more candidates in the JSON; {} shapes skipped)\n", candidates.size() - a.top,
                             plan.skipped);
  }
  const LayoutCandidate& best = candidates.front();
  if (!best.fits) std::cout << "no candidate fits the memory per device; the best one that does not is shown\n";
  std::cout << "best: " << example_command(a, config, o.seq, best, rates.device) << "\n";
  out["best"] = out["candidates"][0];
  if (!a.json.empty()) {
    cli::write_json(a.json, out);
    std::cout << "wrote " << a.json << "\n";
  }
}

// The precision a measured document ran in: its config's "dtype" (llama_pipeline --costs-json); `twobp_bench
// pipeline` runs float32 and writes none.
Precision measured_precision(const RunDocument& doc) {
  return parse_precision(Json::parse(doc.config_extra).value("dtype", std::string("fp32")));
}

void run_plan(PlanArgs a) {
  if (a.ranks < 1 || a.micro_batch_size < 1) throw std::invalid_argument("--ranks and --micro-batch-size must be >= 1");
  std::vector<std::pair<std::string, std::string>> inputs{{"--ratios-json", a.ratios_json}};
  for (const std::string& path : a.costs_json) inputs.emplace_back("--costs-json", path);
  cli::refuse_shared_paths({{"--json", a.json}}, inputs);
  // The measured files as one document: they must have measured the same model, sequence length, micro-batch
  // size and precision (e.g. a v = 1 and a v = 2 job, whose chunks of two shapes let fit_llama_costs fit every term).
  std::vector<RunDocument> docs;
  for (const std::string& path : a.costs_json) {
    try {
      docs.push_back(read_run_document_file(path));
    } catch (const UsageError& e) {  // names the file, the result and the field; the option too
      throw UsageError(fmt::format("--costs-json: {}", e.what()));
    }
  }
  for (std::size_t k = 1; k < docs.size(); ++k) {
    if (measured_precision(docs[k]) != measured_precision(docs[0])) {
      throw UsageError(fmt::format("--costs-json: {} was measured in {} and {} in {}: the files must measure the "
                                   "same precision",
                                   a.costs_json[0], to_string(measured_precision(docs[0])), a.costs_json[k],
                                   to_string(measured_precision(docs[k]))));
    }
  }
  const std::optional<RunDocument> measured =
      docs.empty() ? std::nullopt : std::optional<RunDocument>(merge_run_documents(docs, a.costs_json));
  if (measured) {
    // Costs measured in one precision say nothing of another's: the plan and its commands keep theirs.
    const Precision precision = measured_precision(*measured);
    if (!a.precision_given) a.precision = precision;
    if (a.precision != precision) {
      throw UsageError(fmt::format("--dtype {}: the costs of --costs-json {} were measured in {}, which says nothing "
                                   "of {}'s; leave --dtype out (or give {}), or measure a {} run",
                                   to_string(a.precision), a.costs_json.front(), to_string(precision),
                                   to_string(a.precision), to_string(precision), to_string(a.precision)));
    }
  }
  const std::string measured_files = fmt::format("{}", fmt::join(a.costs_json, " + "));
  const llm::LlamaConfig config = config_of(a, measured ? &*measured : nullptr, measured_files);
  LayoutPlanOptions o;
  o.ranks = a.ranks;
  o.seq = a.seq > 0 ? a.seq : config.max_seq_len;
  o.micro_batch_size = a.micro_batch_size;
  o.global_batch = a.global_batch > 0 ? a.global_batch : 8 * a.ranks * a.micro_batch_size;
  o.max_dp = a.max_dp;
  o.schedules = name_list(a.schedule, schedule_names(), "schedule");
  o.modes = mode_list(a.mode);
  o.recompute.clear();
  if (a.recompute != "on") o.recompute.push_back(false);
  if (a.recompute != "off") o.recompute.push_back(true);
  o.precision = llm::training_precision(a.precision);
  o.memory_limit_bytes = a.gpu_memory_gb * kGiB;
  o.link_bytes_per_s = a.link_gbps * 1e9 / 8;
  o.link_latency_s = a.link_latency_us * 1e-6;
  Rates rates = measured ? measured_rates(*measured, measured_files, config, o.seq, a.micro_batch_size, a.action_ms)
                         : estimated_rates(a, config, o.seq);
  if (a.overlap >= 0) {
    rates.costs.overlap = a.overlap;
    rates.source += fmt::format("; F&B pairs at once hiding {:g} of the shorter part (--overlap)", a.overlap);
  }
  o.communication_ms =
      activation_bytes(config, a.micro_batch_size, o.seq, o.precision.compute_bytes) * rates.comm_ms_per_byte +
      rates.comm_latency_ms;
  print_plan_header(a, config, o, rates);
  report_plan(a, config, o, rates, plan_llama_layouts(config, rates.costs, o));
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Rank schedule, mode, v, m, recomputation and dp x pp for a model on N ranks by predicted throughput");
  sub->add_option("--model", a->model, "LLaMa preset (tiny, small, 1b, 7b)")->capture_default_str()
      ->check(CLI::IsMember(llm::config_names()));
  sub->add_option("--dim", a->dims.dim, "Custom width (replaces the preset's or the measured model's)")
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--layers", a->dims.layers, "Custom number of blocks")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--heads", a->dims.heads, "Custom attention heads")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--kv-heads", a->dims.kv_heads, "Custom key/value heads")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--ffn", a->dims.ffn, "Custom MLP width")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--vocab", a->dims.vocab, "Custom vocabulary")->check(cli::number_in(1, cli::kMaxCount));
  count_option(sub, "--ranks", a->ranks, "Ranks (GPUs)", 1, 65536);
  sub->add_option("--gpu-memory-gb", a->gpu_memory_gb, "Memory per device in GiB (0: do not filter)")
      ->capture_default_str()->check(cli::number_in(0, 1e6, " (0: do not filter)"));
  sub->add_option("--seq", a->seq, "Tokens per sequence (default: the model's)")
      ->check(cli::number_in(1, cli::kMaxCount));
  count_option(sub, "--micro-batch-size", a->micro_batch_size, "Sequences per micro-batch");
  sub->add_option("--global-batch", a->global_batch, "Sequences per step (default 8 x ranks x micro-batch size)")
      ->check(cli::number_in(1, 1e9));
  // --dtype, as every program spells a precision; --precision is its older name, which spelled bf16-pure "bf16"
  // (refused there, so that no old command line changes meaning). The last one given wins.
  sub->add_option_function<std::string>(
         "--dtype",
         [a](const std::string& dtype) {
           a->precision = parse_precision(dtype);
           a->precision_given = true;
         },
         "fp32; bf16: mixed precision (bfloat16 compute, float32 masters); bf16-pure: everything in bfloat16 "
         "(default: bf16; with --costs-json, the precision they were measured in)")
      ->check(cli::one_spelling(parse_precision, "fp32, bf16, bf16-pure or fp64"));
  const CLI::Validator not_bf16(
      [](std::string& text) -> std::string {
        return text == "bf16" ? "'bf16' here meant everything in bfloat16: say --dtype bf16-pure for that, or "
                                "--dtype bf16 for mixed precision"
                              : std::string();
      },
      "");
  sub->add_option_function<std::string>(
         "--precision",
         [a](const std::string& precision) {
           a->precision = parse_precision(precision);
           a->precision_given = true;
         },
         "The older name of --dtype: fp32, bf16-mixed or bf16-pure")
      ->check(not_bf16)
      ->check(cli::one_spelling(parse_precision, "fp32, bf16-mixed or bf16-pure"));
  count_option(sub, "--tflops", a->tflops, "Estimated costs: sustained TFLOP/s per device", 1e-6, 1e6);
  sub->add_option("--ratios-json", a->ratios_json,
                  "Estimated costs: I, W and B at the ratios to F of this `twobp_bench split` JSON's fast path "
                  "(default: those measured on one 7B stage, docs/GPU.md)")
      ->check(cli::regular_file());
  sub->add_option("--costs-json", a->costs_json,
                  "Measured costs: a `twobp_bench pipeline --mode both` JSON from the target machine (its model "
                  "is planned, with any --dim ... sizes replacing its own; measure a v = 2 schedule too, e.g. "
                  "--schedule 1f1b,interleaved-1f1b, to fit per-action and head costs), or `llama_pipeline "
                  "--costs-json` files; several files (of the same model, sequence length and micro-batch size) "
                  "are fitted together, e.g. a v = 1 and a v = 2 job's")
      ->check(cli::regular_file())->expected(1, -1);
  sub->add_option("--overlap", a->overlap,
                  "DualPipeV's F&B pairs run at once, hiding this share (0..1) of each pair's shorter part: what a "
                  "runtime hook that overlaps them reaches (ExecutorOptions::overlap_forward_backward; the example "
                  "runs pairs in order). Default: the share --costs-json measured, else 0 (in order)")
      ->check(cli::number_in(0, 1));
  sub->add_option_function<double>(
         "--action-ms", [a](double ms) { a->action_ms = ms; },
         "A fixed cost of every action (F, I, W, B), ms: the per-action term of each chunk's costs, paid once per "
         "chunk action, so more chunks pay it more often (measured: `twobp_bench split` at two --layers). "
         "Estimated costs: added to the FLOP time. --costs-json of one chunk shape: taken out of each measured "
         "action before the FLOP shares. Refused where the files' chunk shapes fit the per-action term themselves. "
         "Default: 0, or the fitted term")
      ->check(cli::number_in(0, 1e9));
  sub->add_option("--link-gbps", a->link_gbps, "Link bandwidth per rank, Gb/s (messages and data-parallel rings)")
      ->capture_default_str()->check(cli::number_in(1e-3, 1e6));
  count_option(sub, "--link-latency-us", a->link_latency_us, "Per message / ring step latency, us", 0, 1e9);
  sub->add_option("--schedule", a->schedule, "Schedules to consider: all, or a comma-separated list")
      ->capture_default_str();
  sub->add_option("--mode", a->mode, "standard, 2bp or both")->check(CLI::IsMember(mode_choices()))
      ->capture_default_str();
  sub->add_option("--recompute", a->recompute, "Activation recomputation: off, on or both")
      ->check(CLI::IsMember({"off", "on", "both"}))->capture_default_str();
  count_option(sub, "--top", a->top, "Rows printed");
  sub->add_option("--max-dp", a->max_dp, "Consider data-parallel degrees up to this (default: --ranks)")
      ->check(cli::number_in(1, 65536));
  sub->add_option("--json", a->json, "Write {config, candidates (ranked), best} here")->check(cli::writable_file());
  sub->callback([a] { run_plan(*a); });
}

}  // namespace twobp::bench
