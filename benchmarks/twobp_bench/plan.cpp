// `twobp_bench plan`: which schedule, mode, v, micro-batch count, recomputation and dp × pp layout to run for a
// LLaMa-like model on N ranks, ranked by predicted throughput among the candidates that fit in memory.
//
//   twobp_bench plan --model 7b --ranks 4 --gpu-memory-gb 80 --json plan.json           # estimated costs
//   twobp_bench plan --costs-json pipeline.json --ranks 2 --global-batch 16 --json p.json   # measured costs
//
// Candidates: every dp dividing --ranks (up to --max-dp; pp = ranks / dp) such that dp · micro-batch-size divides
// --global-batch (m = global batch / (dp · micro-batch-size) micro-batches per replica), every schedule of
// --schedule (default: all registered; v = the schedule's default), standard and 2BP (--mode), recomputation off
// and on (--recompute both|off|on). A shape a schedule or the partition rejects is skipped and counted, and so is a
// multi-chunk schedule on a one-rank pipeline (pp = 1), which only cuts the same work into more actions.
//
// Prediction per candidate (one place each, all in twobp):
//   costs      per stage F = partition cost (in blocks, the head's share included: models::make_partition)
//              · block_ms, block_ms = models::block_forward_flops(config, seq) · micro-batch-size / FLOP rate;
//              I = ratio_I · F, W = ratio_W · F, B = ratio_B · F, recompute R = F (CostModel::recompute)
//   FLOP rate  estimated: --tflops (sustained per device), ratios I = W = 1, B = 2; measured (--costs-json, a
//              `twobp_bench pipeline` JSON with a 2bp result): the rate its blocks ran at (Σ F / Σ partition cost
//              of its own model and partition), its Σ I / Σ F, Σ W / Σ F, Σ B / Σ F (standard result; else I + W)
//              and its measured communication, scaled by activation bytes
//   messages   estimated: activation bytes / (--link-gbps) + --link-latency-us
//   dp         each stage's gradients (parameters · gradient bytes of --precision) all-reduced over dp ranks:
//              metrics::ring_all_reduce_seconds on --link-gbps, overlapped with the rank's remaining work
//   step       twobp::simulate(schedule, costs).step_time; tokens_per_s = global batch · seq / step
//   memory     per rank, models::estimate_memory (the formulas of `llama_pipeline --dry-run`, walked through the
//              schedule by simulate_peak_memory) for --precision; fits = every rank <= --gpu-memory-gb (0: all fit)
// Ranking: fitting candidates first, then by predicted tokens/s (ties: less memory). The JSON holds every
// candidate with its prediction, the example command line that runs it on GPUs, and the `twobp_bench pipeline`
// arguments that measure it here (used by the planner check test).

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "twobp/metrics/metrics.h"
#include "twobp/models/llama.h"
#include "twobp/schedule/schedule.h"

namespace twobp::bench {
namespace {

namespace llm = twobp::models;

struct PlanArgs {
  std::string model = "7b";
  // Custom dimensions (override the preset's when > 0).
  int64_t dim = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  int ranks = 4;
  double gpu_memory_gb = 0;
  int64_t seq = 0;  // 0: the model's max_seq_len
  int64_t micro_batch_size = 1;
  int64_t global_batch = 0;  // sequences per step; 0: 8 · ranks · micro-batch-size
  std::string precision = "bf16-mixed";
  double tflops = 400;
  std::string costs_json;
  double link_gbps = 100;
  double link_latency_us = 5;
  std::string schedule = "all";
  std::string mode = "both";
  std::string recompute = "both";
  int top = 10;
  int max_dp = 0;  // 0: up to --ranks
  std::string json;
};

// How fast blocks run and what the backward actions cost relative to F.
struct Rates {
  std::string source;
  double ms_per_flop = 0;
  double ratio_i = 1, ratio_w = 1, ratio_b = 2;
  double comm_ms_per_byte = 0, comm_latency_ms = 0;
};

struct Candidate {
  std::string schedule;
  BackwardMode mode = BackwardMode::kSplit;
  int dp = 1, pp = 1, v = 1, m = 1;
  bool recompute = false;
  double step_ms = 0, tokens_per_s = 0, bubble = 0;
  std::vector<double> memory_per_rank;
  double peak_memory = 0;
  bool fits = true;
};

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

std::vector<double> numbers_of(const Json& j, const char* key) {
  std::vector<double> out;
  if (j.contains(key)) {
    for (const auto& x : j.at(key)) out.push_back(x.get<double>());
  }
  return out;
}

llm::LlamaConfig config_of(const PlanArgs& a, const Json* measured_config) {
  llm::LlamaConfig c;
  if (measured_config != nullptr && a.dim == 0) {
    // The measured benchmark's own model (twobp_bench pipeline --model llama).
    const Json& j = *measured_config;
    c.name = "measured";
    c.dim = j.at("dim").get<int64_t>();
    c.n_layers = j.at("layers").get<int>();
    c.n_heads = j.at("heads").get<int>();
    c.n_kv_heads = j.at("kv_heads").get<int>();
    c.ffn_dim = j.at("ffn").get<int64_t>();
    c.vocab_size = j.at("vocab").get<int64_t>();
    c.max_seq_len = j.at("seq").get<int64_t>();
  } else {
    c = llm::config_by_name(a.model);
  }
  if (a.dim > 0) c.dim = a.dim;
  if (a.layers > 0) c.n_layers = static_cast<int>(a.layers);
  if (a.heads > 0) c.n_heads = static_cast<int>(a.heads);
  if (a.kv_heads > 0) c.n_kv_heads = static_cast<int>(a.kv_heads);
  if (a.ffn > 0) c.ffn_dim = a.ffn;
  if (a.vocab > 0) c.vocab_size = a.vocab;
  if (a.dim > 0 || a.layers > 0) c.name = "custom";
  c.validate();
  return c;
}

// Bytes of one activation message (a micro-batch's hidden state) in the compute dtype.
double activation_bytes(const llm::LlamaConfig& c, int64_t mbs, int64_t seq, int64_t bytes) {
  return static_cast<double>(mbs * seq * c.dim * bytes);
}

Rates measured_rates(const Json& doc, const std::string& path) {
  const Json& cfg = doc.at("config");
  if (cfg.value("model", "llama") != "llama") {
    throw std::runtime_error(path + ": the planner models LLaMa-like stacks; this benchmark ran --model " +
                             cfg.value("model", std::string()));
  }
  // The first result of `mode` run plainly (no data parallelism, memory limit or announced shapes), of the same
  // schedule and p as `like` when given.
  auto first_plain = [&](const char* mode, const Json* like) -> const Json* {
    for (const auto& r : doc.at("results")) {
      if (r.value("dp", 1) != 1 || r.contains("memory_limit_bytes") || r.value("shapes", "fixed") != "fixed" ||
          r.value("mode", "") != mode) {
        continue;
      }
      if (like == nullptr || (r.value("schedule", "") == (*like)["schedule"] && r.value("p", 0) == (*like)["p"])) {
        return &r;
      }
    }
    return nullptr;
  };
  const Json* split = first_plain("2bp", nullptr);
  if (split == nullptr) throw std::runtime_error(path + ": no 2bp result (run `twobp_bench pipeline --mode both`)");
  const Json* standard = first_plain("standard", split);
  PlanArgs measured_args;
  const llm::LlamaConfig c = config_of(measured_args, &cfg);
  const int64_t seq = cfg.at("seq").get<int64_t>(), mbs = cfg.at("micro_batch_size").get<int64_t>();
  const int stages = (*split)["p"].get<int>() * (*split)["v"].get<int>();
  const auto partition = llm::make_partition(c, stages, seq);
  const std::vector<double> F = numbers_of((*split)["costs_ms"], "F"), I = numbers_of((*split)["costs_ms"], "I"),
                            W = numbers_of((*split)["costs_ms"], "W");
  const double units = sum(partition.cost);
  if (sum(F) <= 0 || units <= 0) throw std::runtime_error(path + ": the 2bp result has no forward costs");
  Rates r;
  r.ms_per_flop = sum(F) / units / (llm::block_forward_flops(c, seq) * static_cast<double>(mbs));
  r.ratio_i = sum(I) / sum(F);
  r.ratio_w = sum(W) / sum(F);
  const std::vector<double> B = standard ? numbers_of((*standard)["costs_ms"], "B") : std::vector<double>{};
  r.ratio_b = sum(B) > 0 ? sum(B) / sum(F) : r.ratio_i + r.ratio_w;
  // The measured message time, per byte of the measured activation (its latency is not separable).
  r.comm_ms_per_byte = (*split)["communication_ms"].get<double>() / activation_bytes(c, mbs, seq, 4);
  r.source = fmt::format("measured: {} ({} 2bp p={} v={}): {:.3g} ms per block-forward GFLOP, I/F {:.3f}, W/F "
                         "{:.3f}, B/F {:.3f}{}",
                         path, (*split)["schedule"].get<std::string>(), (*split)["p"].get<int>(),
                         (*split)["v"].get<int>(), r.ms_per_flop * 1e9, r.ratio_i, r.ratio_w, r.ratio_b,
                         standard ? "" : " (B = I + W: no standard result)");
  return r;
}

// The example's --dtype for a training precision.
std::string example_dtype(const std::string& precision) {
  return precision == "bf16-mixed" ? "bf16" : precision == "bf16" ? "bf16-pure" : "fp32";
}

std::string example_command(const PlanArgs& a, const llm::LlamaConfig& c, int64_t seq, const Candidate& k) {
  const std::string model = c.name == "custom" || c.name == "measured" ? "<no preset: custom dimensions>" : c.name;
  return fmt::format("torchrun --nproc-per-node {} --no-python build/examples/llama_pipeline --model {} --device cuda "
                     "--dtype {} --schedule {} --chunks-per-rank {} --microbatches {} --micro-batch-size {} "
                     "--seq-len {}{}{}{}",
                     a.ranks, model, example_dtype(a.precision), k.schedule, k.v, k.m, a.micro_batch_size, seq,
                     k.dp > 1 ? fmt::format(" --dp {}", k.dp) : "", k.mode == BackwardMode::kSplit ? "" : " --no-2bp",
                     k.recompute ? " --recompute" : "");
}

// `twobp_bench pipeline` arguments that measure candidate k on this machine (ranks as threads).
std::vector<std::string> bench_args(const llm::LlamaConfig& c, int64_t seq, int64_t mbs, const Candidate& k) {
  std::vector<std::string> args{"pipeline",
                                "--ranks", std::to_string(k.pp),
                                "--dp", std::to_string(k.dp),
                                "--schedule", k.schedule,
                                "--chunks-per-rank", std::to_string(k.v),
                                "--mode", mode_name(k.mode),
                                "--microbatches", std::to_string(k.m),
                                "--micro-batch-size", std::to_string(mbs),
                                "--dim", std::to_string(c.dim),
                                "--layers", std::to_string(c.n_layers),
                                "--heads", std::to_string(c.n_heads),
                                "--kv-heads", std::to_string(c.n_kv_heads),
                                "--ffn", std::to_string(c.ffn_dim),
                                "--vocab", std::to_string(c.vocab_size),
                                "--seq", std::to_string(seq)};
  if (k.recompute) args.push_back("--recompute");
  return args;
}

void run_plan(const PlanArgs& a) {
  if (a.ranks < 1 || a.micro_batch_size < 1) throw std::invalid_argument("--ranks and --micro-batch-size must be >= 1");
  Json measured_doc;
  const Json* measured_config = nullptr;
  if (!a.costs_json.empty()) {
    measured_doc = read_json(a.costs_json);
    if (!measured_doc.contains("config") || !measured_doc.contains("results")) {
      throw std::runtime_error(a.costs_json + ": not a `twobp_bench pipeline` JSON (no config/results)");
    }
    measured_config = &measured_doc["config"];
  }
  const llm::LlamaConfig config = config_of(a, measured_config);
  const int64_t seq = a.seq > 0 ? a.seq : config.max_seq_len;
  const int64_t global_batch = a.global_batch > 0 ? a.global_batch : 8 * a.ranks * a.micro_batch_size;
  const llm::TrainingPrecision precision = llm::training_precision(a.precision);
  const double link_bytes_per_s = a.link_gbps * 1e9 / 8;
  Rates rates;
  if (measured_config != nullptr) {
    rates = measured_rates(measured_doc, a.costs_json);
  } else {
    if (!(a.tflops > 0)) throw std::invalid_argument("--tflops must be > 0");
    rates.ms_per_flop = 1e3 / (a.tflops * 1e12);
    rates.comm_ms_per_byte = 1e3 / link_bytes_per_s;
    rates.comm_latency_ms = a.link_latency_us * 1e-3;
    rates.source = fmt::format("estimated: {} TFLOP/s per device, I = W = F, B = 2F, links {} Gb/s + {} us", a.tflops,
                               a.link_gbps, a.link_latency_us);
  }
  const double block_ms = llm::block_forward_flops(config, seq) * static_cast<double>(a.micro_batch_size) *
                          rates.ms_per_flop;
  const double comm_ms =
      activation_bytes(config, a.micro_batch_size, seq, precision.compute_bytes) * rates.comm_ms_per_byte +
      rates.comm_latency_ms;

  const std::vector<std::string> schedules = name_list(a.schedule, schedule_names(), "schedule");
  std::vector<BackwardMode> modes;
  if (a.mode != "2bp") modes.push_back(BackwardMode::kStandard);
  if (a.mode != "standard") modes.push_back(BackwardMode::kSplit);
  std::vector<bool> recomputes;
  if (a.recompute != "on") recomputes.push_back(false);
  if (a.recompute != "off") recomputes.push_back(true);

  std::vector<Candidate> candidates;
  int skipped = 0;
  const int max_dp = a.max_dp > 0 ? std::min(a.max_dp, a.ranks) : a.ranks;
  for (int dp = 1; dp <= max_dp; ++dp) {
    if (a.ranks % dp != 0 || global_batch % (dp * a.micro_batch_size) != 0) continue;
    const int pp = a.ranks / dp;
    const int m = static_cast<int>(global_batch / (dp * a.micro_batch_size));
    for (const auto& name : schedules) {
      for (BackwardMode mode : modes) {
        Schedule schedule;
        llm::Partition partition;
        try {
          schedule = make_schedule(name, default_schedule_options(name, pp, m, mode));
          partition = llm::make_partition(config, schedule.num_stages, seq);
        } catch (const std::exception&) {
          ++skipped;  // a shape this schedule or the model's layer count does not allow
          continue;
        }
        // Several chunks on the only rank interleave nothing: the same work in more actions (measured slower).
        if (pp == 1 && schedule.num_stages > 1) {
          ++skipped;
          continue;
        }
        for (bool recompute : recomputes) {
          CostModel costs;
          costs.communication = comm_ms;
          for (int s = 0; s < schedule.num_stages; ++s) {
            const double f = std::max(1e-9, partition.cost[s] * block_ms);
            costs.forward.push_back(f);
            costs.backward_input.push_back(mode == BackwardMode::kSplit ? rates.ratio_i * f : 0.0);
            costs.backward_weight.push_back(mode == BackwardMode::kSplit ? rates.ratio_w * f : 0.0);
            costs.backward.push_back(rates.ratio_b * f);
            if (recompute) costs.recompute.push_back(f);
            if (dp > 1) {
              const double bytes = static_cast<double>(llm::chunk_parameter_count(config, partition.chunks[s]) *
                                                       precision.gradient_bytes);
              costs.data_parallel_reduce.push_back(
                  1e3 * metrics::ring_all_reduce_seconds(bytes, dp, link_bytes_per_s, a.link_latency_us * 1e-6));
            }
          }
          const SimulationResult sim = simulate(schedule, costs);
          Candidate k;
          k.schedule = name;
          k.mode = mode;
          k.dp = dp;
          k.pp = pp;
          k.v = schedule.num_stages / pp;
          k.m = m;
          k.recompute = recompute;
          k.step_ms = sim.step_time;
          k.bubble = sim.bubble_fraction;
          k.tokens_per_s = metrics::tokens_per_s(
              metrics::per_second(static_cast<double>(global_batch), sim.step_time / 1000.0), seq);
          llm::MemoryPlanOptions mo;
          mo.micro_batch_size = a.micro_batch_size;
          mo.seq_len = seq;
          mo.precision = precision;
          mo.recompute = recompute;
          for (const auto& e : llm::estimate_memory(config, partition, schedule, mo)) {
            k.memory_per_rank.push_back(e.total);
          }
          k.peak_memory = *std::max_element(k.memory_per_rank.begin(), k.memory_per_rank.end());
          k.fits = a.gpu_memory_gb <= 0 || k.peak_memory <= a.gpu_memory_gb * kGiB;
          candidates.push_back(std::move(k));
        }
      }
    }
  }
  if (candidates.empty()) {
    throw std::runtime_error(fmt::format("no candidate: no dp divides --ranks {} with the global batch {} "
                                         "(micro-batch size {}), or every schedule rejected its shape",
                                         a.ranks, global_batch, a.micro_batch_size));
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& x, const Candidate& y) {
    if (x.fits != y.fits) return x.fits;
    if (x.tokens_per_s != y.tokens_per_s) return x.tokens_per_s > y.tokens_per_s;
    return x.peak_memory < y.peak_memory;
  });

  std::cout << fmt::format("plan: model {} ({:.3g} B parameters), {} ranks, global batch {} x {} tokens, "
                           "precision {}, memory per device {}\n  costs {}\n",
                           config.name, static_cast<double>(llm::parameter_count(config)) / 1e9, a.ranks,
                           global_batch, seq, precision.name,
                           a.gpu_memory_gb > 0 ? fmt::format("{:g} GiB", a.gpu_memory_gb) : "not limited",
                           rates.source);
  std::vector<std::vector<std::string>> rows{{"#", "schedule", "mode", "v", "m", "recompute", "dp x pp", "tokens/s",
                                              "step ms", "bubble", "peak GiB", "fits"}};
  Json out;
  out["config"] = {{"model", config.name},      {"parameters", llm::parameter_count(config)},
                   {"ranks", a.ranks},          {"seq", seq},
                   {"micro_batch_size", a.micro_batch_size}, {"global_batch", global_batch},
                   {"precision", precision.name}, {"gpu_memory_gb", a.gpu_memory_gb},
                   {"costs", rates.source},     {"skipped_shapes", skipped}};
  out["candidates"] = Json::array();
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& k = candidates[i];
    if (static_cast<int>(i) < a.top) {
      rows.push_back({std::to_string(i + 1), k.schedule, mode_name(k.mode),
                      std::to_string(k.v), std::to_string(k.m), k.recompute ? "yes" : "no",
                      fmt::format("{} x {}", k.dp, k.pp), fmt_num(k.tokens_per_s, 0), fmt_num(k.step_ms, 1),
                      fmt_num(k.bubble, 3), fmt_num(k.peak_memory / kGiB, 2), k.fits ? "yes" : "no"});
    }
    out["candidates"].push_back({{"rank", i + 1},
                                 {"schedule", k.schedule},
                                 {"mode", mode_name(k.mode)},
                                 {"v", k.v},
                                 {"m", k.m},
                                 {"recompute", k.recompute},
                                 {"dp", k.dp},
                                 {"pp", k.pp},
                                 {"sim_tokens_per_s", k.tokens_per_s},
                                 {"sim_step_ms", k.step_ms},
                                 {"sim_bubble_fraction", k.bubble},
                                 {"peak_memory_bytes_per_rank", k.memory_per_rank},
                                 {"peak_memory_bytes", k.peak_memory},
                                 {"fits", k.fits},
                                 {"command", example_command(a, config, seq, k)},
                                 {"bench_args", bench_args(config, seq, a.micro_batch_size, k)}});
  }
  print_table(std::cout, rows);
  if (candidates.size() > static_cast<std::size_t>(a.top)) {
    std::cout << fmt::format("({} more candidates in the JSON; {} shapes skipped)\n", candidates.size() - a.top,
                             skipped);
  }
  const Candidate& best = candidates.front();
  if (!best.fits) std::cout << "no candidate fits the memory per device; the best one that does not is shown\n";
  std::cout << "best: " << example_command(a, config, seq, best) << "\n";
  out["best"] = out["candidates"][0];
  if (!a.json.empty()) {
    write_json(a.json, out);
    std::cout << "wrote " << a.json << "\n";
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Rank schedule, mode, v, m, recomputation and dp x pp for a model on N ranks by predicted throughput");
  sub->add_option("--model", a->model, "LLaMa preset (tiny, small, 1b, 7b)")->capture_default_str()
      ->check(CLI::IsMember(llm::config_names()));
  sub->add_option("--dim", a->dim, "Custom width (overrides the preset's; with --layers etc.)");
  sub->add_option("--layers", a->layers, "Custom number of blocks");
  sub->add_option("--heads", a->heads, "Custom attention heads");
  sub->add_option("--kv-heads", a->kv_heads, "Custom key/value heads");
  sub->add_option("--ffn", a->ffn, "Custom MLP width");
  sub->add_option("--vocab", a->vocab, "Custom vocabulary");
  sub->add_option("--ranks", a->ranks, "Ranks (GPUs)")->capture_default_str();
  sub->add_option("--gpu-memory-gb", a->gpu_memory_gb, "Memory per device in GiB (0: do not filter)")
      ->capture_default_str();
  sub->add_option("--seq", a->seq, "Tokens per sequence (default: the model's)");
  sub->add_option("--micro-batch-size", a->micro_batch_size, "Sequences per micro-batch")->capture_default_str();
  sub->add_option("--global-batch", a->global_batch, "Sequences per step (default 8 x ranks x micro-batch size)");
  sub->add_option("--precision", a->precision, "fp32, bf16 (everything) or bf16-mixed (fp32 masters)")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-mixed"}))->capture_default_str();
  sub->add_option("--tflops", a->tflops, "Estimated costs: sustained TFLOP/s per device")->capture_default_str();
  sub->add_option("--costs-json", a->costs_json,
                  "Measured costs: a `twobp_bench pipeline --mode both` JSON from the target machine (its model "
                  "is planned unless --model dimensions are given)")
      ->check(CLI::ExistingFile);
  sub->add_option("--link-gbps", a->link_gbps, "Link bandwidth per rank, Gb/s (messages and data-parallel rings)")
      ->capture_default_str();
  sub->add_option("--link-latency-us", a->link_latency_us, "Per message / ring step latency, us")
      ->capture_default_str();
  sub->add_option("--schedule", a->schedule, "Schedules to consider: all, or a comma-separated list")
      ->capture_default_str();
  sub->add_option("--mode", a->mode, "standard, 2bp or both")->check(CLI::IsMember({"standard", "2bp", "both"}))
      ->capture_default_str();
  sub->add_option("--recompute", a->recompute, "Activation recomputation: off, on or both")
      ->check(CLI::IsMember({"off", "on", "both"}))->capture_default_str();
  sub->add_option("--top", a->top, "Rows printed")->capture_default_str();
  sub->add_option("--max-dp", a->max_dp, "Consider data-parallel degrees up to this (default: --ranks)");
  sub->add_option("--json", a->json, "Write {config, candidates (ranked), best} here");
  sub->callback([a] { run_plan(*a); });
}

}  // namespace twobp::bench
