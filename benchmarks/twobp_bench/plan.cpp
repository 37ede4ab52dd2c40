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
//   costs      per chunk and action type X in {F, I, W, B}, affine in what the chunk holds:
//                X(chunk) = a_X + b_X · blocks + e_X · [embedding] + h_X · [head]      (ChunkCost), recompute R = F
//              estimated: b_F = models::block_forward_flops(config, seq) · micro-batch-size / (--tflops),
//              h_F = models::head_cost_in_blocks · b_F, a = e = 0; I = W = F, B = 2F
//              measured (--costs-json, a `twobp_bench pipeline` JSON): a, b, e, h of each X fitted by least squares
//              over the chunks of its plain results (F from every mode, I and W from 2bp, B from standard, else
//              B = I + W), which needs two chunk shapes per end (e.g. a v = 1 and a v = 2 schedule); with one
//              shape, F at its FLOP shares (b_F = Σ F / Σ (blocks + head share)) and I, W, B at their Σ ratios
//              to F. Carried to another model, seq or micro-batch size: b and h by their FLOPs, e by tokens · dim
//              (the embedding's output), a unchanged.
//   messages   estimated: activation bytes / (--link-gbps) + --link-latency-us; measured: the first 2bp result's
//              communication_ms per byte of its activation, times the planned activation's bytes
//   dp         each stage's gradients (parameters · gradient bytes of --precision) all-reduced over dp ranks:
//              metrics::ring_all_reduce_seconds on --link-gbps, overlapped with the rank's remaining work
//   step       twobp::simulate(schedule, costs).step_time; tokens_per_s = global batch · seq / step
//   memory     per rank, models::estimate_memory (the formulas of `llama_pipeline --dry-run`, walked through the
//              schedule by simulate_peak_memory) for --precision; fits = every rank <= --gpu-memory-gb (0: all fit)
// Ranking: fitting candidates first, then by predicted tokens/s (ties: less memory). The JSON holds every
// candidate with its prediction, the example command line that runs it on GPUs, and the `twobp_bench pipeline`
// arguments that measure it here (used by the planner check test).

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "twobp/metrics/metrics.h"
#include "twobp/models/llama.h"
#include "twobp/plan/measure.h"
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

// One action type's cost on a chunk, affine in what the chunk holds (ms):
//   cost = per_action + per_block · blocks + embedding · [holds the embedding] + head · [holds the head]
struct ChunkCost {
  double per_action = 0, per_block = 0, embedding = 0, head = 0;

  double of(const llm::ChunkSpec& c) const {
    return per_action + per_block * c.num_layers() + (c.has_embedding ? embedding : 0.0) + (c.has_head ? head : 0.0);
  }
  ChunkCost scaled(double k) const { return {k * per_action, k * per_block, k * embedding, k * head}; }
  std::string str() const {
    return fmt::format("{:.3g} + {:.3g}/block + {:.3g} embedding + {:.3g} head", per_action, per_block, embedding,
                       head);
  }
  Json json() const { return {{"per_action", per_action}, {"per_block", per_block}, {"embedding", embedding},
                              {"head", head}}; }
};

// What the actions and messages cost on the planned model.
struct Rates {
  std::string source;
  std::string model = "estimated";  // "estimated", "fitted" (measured, per chunk) or "flop_shares" (measured)
  ChunkCost F, I, W, B;
  double comm_ms_per_byte = 0, comm_latency_ms = 0;
  // Where the costs hold: estimated ones for GPUs (--tflops per device); measured ones where `twobp_bench
  // pipeline` ran, on CPU. The suggested command runs there.
  std::string device = "cuda";
  std::vector<std::string> warnings;  // e.g. negative fitted terms
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

llm::LlamaConfig config_of(const PlanArgs& a, const Json* measured_config) {
  if (measured_config == nullptr) return llm::with_dims(llm::config_by_name(a.model), a.dims);
  // The measured benchmark's own model (twobp_bench pipeline --model llama).
  const Json& j = *measured_config;
  llm::LlamaConfig c;
  c.name = "measured";
  c.dim = j.at("dim").get<int64_t>();
  c.n_layers = j.at("layers").get<int>();
  c.n_heads = j.at("heads").get<int>();
  c.n_kv_heads = j.at("kv_heads").get<int>();
  c.ffn_dim = j.at("ffn").get<int64_t>();
  c.vocab_size = j.at("vocab").get<int64_t>();
  c.max_seq_len = j.at("seq").get<int64_t>();
  c.validate();
  return llm::with_dims(c, a.dims);
}

// Bytes of one activation message (a micro-batch's hidden state) in the compute dtype.
double activation_bytes(const llm::LlamaConfig& c, int64_t mbs, int64_t seq, int64_t bytes) {
  return static_cast<double>(mbs * seq * c.dim * bytes);
}

// The FLOP-share model of one action type: per_block = ms per block, the head at its FLOP share of a block, no
// per-action or embedding term (what estimated costs use, and measured ones with too few chunk shapes to fit).
ChunkCost flop_shares(const llm::LlamaConfig& c, int64_t seq, double block_ms) {
  return {0.0, block_ms, 0.0, llm::head_cost_in_blocks(c, seq) * block_ms};
}

// One action type's measured costs: a row (1, blocks, embedding?, head?) and a cost (ms) per chunk.
struct Samples {
  std::vector<std::array<double, 4>> rows;
  std::vector<double> ms;

  void add(const llm::ChunkSpec& c, double cost) {
    rows.push_back({1.0, static_cast<double>(c.num_layers()), c.has_embedding ? 1.0 : 0.0, c.has_head ? 1.0 : 0.0});
    ms.push_back(cost);
  }
  double total() const { return std::accumulate(ms.begin(), ms.end(), 0.0); }

  // Least squares of the four terms of ChunkCost (at::linalg_lstsq), when the chunk shapes determine all four
  // (full column rank: e.g. the chunks of one v = 1 and one v = 2 pipeline); nullopt otherwise.
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

// Measured costs carried to another model, sequence length or micro-batch size: block and head terms by their
// FLOPs, the embedding by its output elements, the per-action term unchanged.
ChunkCost carried(const ChunkCost& k, const llm::LlamaConfig& from, int64_t from_seq, int64_t from_mbs,
                  const llm::LlamaConfig& to, int64_t to_seq, int64_t to_mbs) {
  const double batch = static_cast<double>(to_mbs) / static_cast<double>(from_mbs);
  return {k.per_action,
          k.per_block * batch * llm::block_forward_flops(to, to_seq) / llm::block_forward_flops(from, from_seq),
          k.embedding * batch * static_cast<double>(to_seq * to.dim) / static_cast<double>(from_seq * from.dim),
          k.head * batch * llm::head_forward_flops(to, to_seq) / llm::head_forward_flops(from, from_seq)};
}

// Costs measured by `twobp_bench pipeline` (`doc`, read from `path`) on its own model, fitted per action type
// over the chunks of every plain result (no data parallelism, memory limit or announced shapes): F from every
// mode, I and W from 2bp results, B from standard ones (else I + W). With chunk shapes of one kind only (a single
// v = 1 pipeline cannot tell the head from the per-action cost), F falls back to its FLOP shares at the measured
// rate and I, W, B to their ratios to F. The costs are then carried() to the planned model `to` at `to_seq` and
// `to_mbs` sequences per micro-batch.
Rates measured_rates(const Json& doc, const std::string& path, const llm::LlamaConfig& to, int64_t to_seq,
                     int64_t to_mbs) {
  const Json& cfg = doc.at("config");
  if (cfg.value("model", "llama") != "llama") {
    throw std::runtime_error(path + ": the planner models LLaMa-like stacks; this benchmark ran --model " +
                             cfg.value("model", std::string()));
  }
  const llm::LlamaConfig c = config_of(PlanArgs{}, &cfg);
  const int64_t seq = cfg.at("seq").get<int64_t>(), mbs = cfg.at("micro_batch_size").get<int64_t>();
  Samples F, I, W, B;
  double f_split = 0, f_standard = 0;  // F summed over the 2bp and over the standard results (for the ratios)
  double f_units = 0;                  // Σ partition cost (blocks + head share) of the chunks behind F
  std::vector<std::string> used;
  double comm_ms = -1;
  for (std::size_t k = 0; k < doc.at("results").size(); ++k) {
    const Json& r = doc.at("results")[k];
    if (r.value("dp", 1) != 1 || r.contains("memory_limit_bytes") || r.value("shapes", "fixed") != "fixed") continue;
    const std::string mode = r.value("mode", "");
    const int stages = r.at("p").get<int>() * r.at("v").get<int>();
    const auto partition = llm::make_partition(c, stages, seq);
    const MeasuredCosts costs = parse_measured_costs(r.dump(), fmt::format("{}: result {}", path, k));
    auto take = [&](Samples& into, const std::vector<double>& x) {  // returns how many chunks it took
      const int n = std::min(stages, static_cast<int>(x.size()));
      for (int s = 0; s < n; ++s) into.add(partition.chunks[s], x[s]);
      return n;
    };
    const double f_before = F.total();
    const int f_chunks = take(F, costs.forward);
    (mode == "2bp" ? f_split : f_standard) += F.total() - f_before;
    for (int s = 0; s < f_chunks; ++s) f_units += partition.cost[s];
    if (mode == "2bp") {
      take(I, costs.backward_input);
      take(W, costs.backward_weight);
      if (comm_ms < 0) comm_ms = costs.communication;
    } else {
      take(B, costs.backward);
    }
    used.push_back(fmt::format("{} {} p={} v={}", r.value("schedule", ""), mode, r.at("p").get<int>(),
                               r.at("v").get<int>()));
  }
  if (comm_ms < 0) throw std::runtime_error(path + ": no 2bp result (run `twobp_bench pipeline --mode both`)");
  if (F.total() <= 0) throw std::runtime_error(path + ": the results have no forward costs");
  Rates rates;
  std::string how;
  if (auto f = F.fit(), i = I.fit(), w = W.fit(); f && i && w) {
    rates.F = *f;
    rates.I = *i;
    rates.W = *w;
    const std::optional<ChunkCost> b = B.fit();
    rates.B = b ? *b
                : ChunkCost{i->per_action + w->per_action, i->per_block + w->per_block, i->embedding + w->embedding,
                            i->head + w->head};
    rates.model = "fitted";
    // Noise can make a fitted term negative; the predictions clamp every chunk's cost at 0, but say so.
    const std::pair<const char*, const ChunkCost*> fitted[] = {{"F", &rates.F}, {"I", &rates.I}, {"W", &rates.W},
                                                               {"B", &rates.B}};
    for (const auto& [name, k] : fitted) {
      const std::pair<const char*, double> terms[] = {{"per action", k->per_action}, {"per block", k->per_block},
                                                      {"embedding", k->embedding}, {"head", k->head}};
      for (const auto& [term, value] : terms) {
        if (value < 0) {
          rates.warnings.push_back(fmt::format("fitted {} cost {} is negative ({:.4g} ms): the measured costs are "
                                               "noisy; measure more steps (--steps) or on an idle machine",
                                               name, term, value));
        }
      }
    }
    how = fmt::format("fitted per chunk: F {}; I {}; W {}; B {}", rates.F.str(), rates.I.str(), rates.W.str(),
                      rates.B.str());
  } else {
    rates.F = flop_shares(c, seq, F.total() / f_units);
    const double ratio_i = I.total() / f_split, ratio_w = W.total() / f_split;
    rates.I = rates.F.scaled(ratio_i);
    rates.W = rates.F.scaled(ratio_w);
    rates.B = rates.F.scaled(B.total() > 0 && f_standard > 0 ? B.total() / f_standard : ratio_i + ratio_w);
    rates.model = "flop_shares";
    how = fmt::format("FLOP shares (one chunk shape: measure a v = 2 schedule too to fit per-action and head "
                      "costs): {:.3g} ms per block, I/F {:.3f}, W/F {:.3f}, B/F {:.3f}",
                      rates.F.per_block, ratio_i, ratio_w, rates.B.per_block / rates.F.per_block);
  }
  // The measured message time, per byte of the measured activation (its latency is not separable).
  rates.comm_ms_per_byte = comm_ms / activation_bytes(c, mbs, seq, 4);
  rates.source = fmt::format("measured: {} ({}): {}", path, fmt::join(used, ", "), how);
  rates.device = "cpu";
  for (ChunkCost* k : {&rates.F, &rates.I, &rates.W, &rates.B}) *k = carried(*k, c, seq, mbs, to, to_seq, to_mbs);
  return rates;
}

// The example's --dtype for a training precision (llm::training_precision's names), and back.
std::string example_dtype(const std::string& precision) {
  return precision == "bf16-mixed" ? "bf16" : precision == "bf16" ? "bf16-pure" : "fp32";
}
std::string precision_of_dtype(const std::string& dtype) {
  return dtype == "bf16" ? "bf16-mixed" : dtype == "bf16-pure" ? "bf16" : "fp32";
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

std::string example_command(const PlanArgs& a, const llm::LlamaConfig& c, int64_t seq, const Candidate& k,
                            const std::string& device) {
  return fmt::format("torchrun --nproc-per-node {} --no-python build/examples/llama_pipeline {} --device {} "
                     "--dtype {} --schedule {} --chunks-per-rank {} --microbatches {} --micro-batch-size {} "
                     "--seq-len {}{}{}{}",
                     a.ranks, example_model(c), device, example_dtype(a.precision), k.schedule, k.v, k.m,
                     a.micro_batch_size, seq, k.dp > 1 ? fmt::format(" --dp {}", k.dp) : "",
                     k.mode == BackwardMode::kSplit ? "" : " --no-2bp", k.recompute ? " --recompute" : "");
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
    rates = measured_rates(measured_doc, a.costs_json, config, seq, a.micro_batch_size);
  } else {
    if (!(a.tflops > 0)) throw std::invalid_argument("--tflops must be > 0");
    rates.F = flop_shares(config, seq,
                          llm::block_forward_flops(config, seq) * static_cast<double>(a.micro_batch_size) * 1e3 /
                              (a.tflops * 1e12));
    rates.I = rates.F;
    rates.W = rates.F;
    rates.B = rates.F.scaled(2.0);
    rates.comm_ms_per_byte = 1e3 / link_bytes_per_s;
    rates.comm_latency_ms = a.link_latency_us * 1e-3;
    rates.source = fmt::format("estimated: {} TFLOP/s per device, I = W = F, B = 2F, links {} Gb/s + {} us", a.tflops,
                               a.link_gbps, a.link_latency_us);
  }
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
            // A fitted term may be negative (noise); no action is free.
            auto cost = [&](const ChunkCost& k) { return std::max(1e-9, k.of(partition.chunks[s])); };
            const double f = cost(rates.F);
            costs.forward.push_back(f);
            costs.backward_input.push_back(mode == BackwardMode::kSplit ? cost(rates.I) : 0.0);
            costs.backward_weight.push_back(mode == BackwardMode::kSplit ? cost(rates.W) : 0.0);
            costs.backward.push_back(cost(rates.B));
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
  // The per-chunk cost terms (ms) the predictions used, on the planned model.
  out["config"]["cost_model"] = {{"kind", rates.model}, {"F", rates.F.json()}, {"I", rates.I.json()},
                                 {"W", rates.W.json()}, {"B", rates.B.json()}};
  out["config"]["device"] = rates.device;
  out["warnings"] = rates.warnings;
  for (const std::string& w : rates.warnings) std::cerr << "twobp_bench plan: warning: " << w << "\n";
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
                                 {"command", example_command(a, config, seq, k, rates.device)},
                                 {"bench_args", bench_args(config, seq, a.micro_batch_size, k)}});
  }
  print_table(std::cout, rows);
  if (candidates.size() > static_cast<std::size_t>(a.top)) {
    std::cout << fmt::format("({} more candidates in the JSON; {} shapes skipped)\n", candidates.size() - a.top,
                             skipped);
  }
  const Candidate& best = candidates.front();
  if (!best.fits) std::cout << "no candidate fits the memory per device; the best one that does not is shown\n";
  std::cout << "best: " << example_command(a, config, seq, best, rates.device) << "\n";
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
  sub->add_option("--dim", a->dims.dim, "Custom width (replaces the preset's or the measured model's)")
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--layers", a->dims.layers, "Custom number of blocks")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--heads", a->dims.heads, "Custom attention heads")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--kv-heads", a->dims.kv_heads, "Custom key/value heads")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--ffn", a->dims.ffn, "Custom MLP width")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--vocab", a->dims.vocab, "Custom vocabulary")->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--ranks", a->ranks, "Ranks (GPUs)")->capture_default_str()->check(cli::number_in(1, 65536));
  sub->add_option("--gpu-memory-gb", a->gpu_memory_gb, "Memory per device in GiB (0: do not filter)")
      ->capture_default_str()->check(cli::number_in(0, 1e6, " (0: do not filter)"));
  sub->add_option("--seq", a->seq, "Tokens per sequence (default: the model's)")
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--micro-batch-size", a->micro_batch_size, "Sequences per micro-batch")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--global-batch", a->global_batch, "Sequences per step (default 8 x ranks x micro-batch size)")
      ->check(cli::number_in(1, 1e9));
  // --dtype in llama_pipeline's words (the one vocabulary); --precision is the older name, in the library's words
  // (llm::training_precision). The last one given wins.
  sub->add_option_function<std::string>(
         "--dtype", [a](const std::string& dtype) { a->precision = precision_of_dtype(dtype); },
         "fp32; bf16: mixed precision (bfloat16 compute, float32 masters); bf16-pure: everything in bfloat16 "
         "(default bf16)")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-pure"}));
  sub->add_option("--precision", a->precision, "The same in the library's words: fp32, bf16-mixed or bf16 (all)")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-mixed"}))->capture_default_str();
  sub->add_option("--tflops", a->tflops, "Estimated costs: sustained TFLOP/s per device")->capture_default_str()
      ->check(cli::number_in(1e-6, 1e6));
  sub->add_option("--costs-json", a->costs_json,
                  "Measured costs: a `twobp_bench pipeline --mode both` JSON from the target machine (its model "
                  "is planned, with any --dim ... sizes replacing its own; measure a v = 2 schedule too, e.g. "
                  "--schedule 1f1b,interleaved-1f1b, to fit per-action and head costs)")
      ->check(CLI::ExistingFile);
  sub->add_option("--link-gbps", a->link_gbps, "Link bandwidth per rank, Gb/s (messages and data-parallel rings)")
      ->capture_default_str()->check(cli::number_in(1e-3, 1e6));
  sub->add_option("--link-latency-us", a->link_latency_us, "Per message / ring step latency, us")
      ->capture_default_str()->check(cli::number_in(0, 1e9));
  sub->add_option("--schedule", a->schedule, "Schedules to consider: all, or a comma-separated list")
      ->capture_default_str();
  sub->add_option("--mode", a->mode, "standard, 2bp or both")->check(CLI::IsMember({"standard", "2bp", "both"}))
      ->capture_default_str();
  sub->add_option("--recompute", a->recompute, "Activation recomputation: off, on or both")
      ->check(CLI::IsMember({"off", "on", "both"}))->capture_default_str();
  sub->add_option("--top", a->top, "Rows printed")->capture_default_str()->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--max-dp", a->max_dp, "Consider data-parallel degrees up to this (default: --ranks)")
      ->check(cli::number_in(1, 65536));
  sub->add_option("--json", a->json, "Write {config, candidates (ranked), best} here")->check(cli::writable_file());
  sub->callback([a] { run_plan(*a); });
}

}  // namespace twobp::bench
