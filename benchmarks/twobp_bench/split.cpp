// `twobp_bench split`: what the 2BP split of the backward costs on one pipeline stage, against the fused backward.
//
// One middle stage (stage_index 1 of 3: its input needs a gradient, no loss) fed a fixed input x and output
// gradient dY, per path (fast: twobp::nn layers; general: the same LLaMa stack of LibTorch layers; general_conv),
// times F, I, W and B: synced and host times, accumulation into existing gradients, a device-timed back-to-back
// run on GPUs, and the top-level ATen operators per block with the host time outside them. docs/BENCHMARKS.md
// defines every variant and output; this file implements them.

#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "twobp_cli.h"
#include "bench_models.h"
#include "commands.h"
#include "twobp/autograd/weight_grad_store.h"
#include "twobp/metrics/memory.h"
#include "twobp/precision.h"
#include "twobp/metrics/step_log.h"
#include "twobp/plan/stage_timer.h"
#include "twobp/runtime/interrupt.h"


namespace twobp::bench {
namespace {

struct SplitConfig {
  LlamaConfig model{/*dim=*/512, /*ffn=*/0};
  int64_t seq = 128;
  int64_t batch = 4;
  int repeats = 15;
  int warmup = 3;
  int threads = 2;
  bool batched_w = false;
  int micro_batches = 4;
  bool conv = true;
  int64_t conv_channels = 64;
  int64_t conv_size = 32;
  int64_t conv_layers = 2;
  std::string json;
  bool check = false;
  bool ops_by_name = false;
  std::string clock = "wall";
  std::string device = "cpu";  // cpu | cuda
  /// fp32; bf16: mixed precision (bfloat16 compute, float32 master weights and gradients, as the pipeline's
  /// MixedPrecisionOptions); bf16-pure: everything in bfloat16.
  Precision precision = Precision::kFloat32;
  std::string paths = "all";  // "all" or a comma-separated list of kPathNames
};

const std::vector<std::string> kPathNames = {"fast", "general", "general_conv"};
constexpr const char* kPhases[] = {"F", "I", "W", "B"};

bool mixed_precision(const SplitConfig& c) { return c.precision == Precision::kMixedBFloat16; }

StageTimerOptions timer_options(const SplitConfig& c) {
  StageTimerOptions options;
  options.mixed_precision = mixed_precision(c);
  options.clock = parse_clock(c.clock);
  return options;
}

at::TensorOptions tensor_options(const SplitConfig& c) {
  return at::TensorOptions()
      .dtype(compute_dtype(c.precision))
      .device(c.device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
}

/// One path under test: the library's StageTimer on its module, and the samples of its phases.
class PathBench {
 public:
  PathBench(std::string name, std::unique_ptr<StageTimer> timer, int64_t blocks)
      : name_(std::move(name)), timer_(std::move(timer)), blocks_(blocks) {}

  const std::string& name() const { return name_; }
  StageTimer& timer() { return *timer_; }

  /// F, I, W with the gradients none (headline) or existing (accumulate/...).
  void split(bool record, bool existing) {
    const StageTimer::Split s = timer_->split(existing);
    if (!record) return;
    if (existing) {
      samples_.add("accumulate/stage1_ms", s.input.synced_ms);
      samples_.add("accumulate/stage2_ms", s.weight.synced_ms);
      return;
    }
    samples_.add("forward_ms", s.forward.synced_ms);
    samples_.add("stage1_ms", s.input.synced_ms);
    samples_.add("stage2_ms", s.weight.synced_ms);
    samples_.add("host_ms/F", s.forward.host_ms);
    samples_.add("host_ms/I", s.input.host_ms);
    samples_.add("host_ms/W", s.weight.host_ms);
    pending_i_ = s.input.synced_ms;
    pending_w_ = s.weight.synced_ms;
    pair_ratios();
  }

  /// F, B with the gradients none (headline) or existing (accumulate/...).
  void fused(bool record, bool existing) {
    const StageTimer::Fused f = timer_->fused(existing);
    if (!record) return;
    if (existing) {
      samples_.add("accumulate/fused_ms", f.backward.synced_ms);
      return;
    }
    samples_.add("forward_ms", f.forward.synced_ms);
    samples_.add("fused_ms", f.backward.synced_ms);
    samples_.add("host_ms/F", f.forward.host_ms);
    samples_.add("host_ms/B", f.backward.host_ms);
    pending_b_ = f.backward.synced_ms;
    pair_ratios();
  }

  void counted(bool record, bool by_name) {
    std::vector<StageTimer::PhaseOps> phases = timer_->count_ops(by_name);
    if (!record) return;
    for (StageTimer::PhaseOps& p : phases) {
      samples_.add("ops/" + p.phase, static_cast<double>(p.ops));
      samples_.add("host_overhead_us/" + p.phase, p.host_overhead_us);
      if (by_name) ops_by_name_[p.phase] = std::move(p.by_name);
    }
  }

  void back_to_back(bool record) {
    const StageTimer::DeviceTimes d = timer_->device_timed();
    if (!record) return;
    samples_.add("device/forward_ms", d.forward_ms);
    samples_.add("device/stage1_ms", d.input_ms);
    samples_.add("device/stage2_ms", d.weight_ms);
    samples_.add("device/fused_ms", d.backward_ms);
  }

  void weight_batch(int m, bool batched, bool record) {
    const PhaseTime w = timer_->weight_batch(m, batched);
    if (record) samples_.add(batched ? "batched_w_ms" : "separate_w_ms", w.synced_ms);
  }

  Json result() const;

  /// W's accumulating branch: the W of micro-batches 0 and 1 one call each (StageTimer::weight_batch), the second
  /// adding into the .grad the first made (the masters' under mixed precision) -- each gradient twice one W's, the
  /// two micro-batches having the same data -- as "accumulated <parameter>.grad" in float32. Needs module_.
  std::map<std::string, at::Tensor> accumulated_gradients();

  int64_t tokens_ = 0;  ///< tokens per micro-batch, for the TFLOP/s of the LLaMa stacks (0: not reported)
  std::shared_ptr<torch::nn::Module> module_;  ///< the timed module (LLaMa stacks), for accumulated_gradients()

 private:
  // Per-repetition ratios once both the split and the fused variant of a repetition are in.
  void pair_ratios() {
    if (pending_b_ < 0 || pending_i_ < 0) return;
    samples_.add("stage1_ratio", pending_i_ / pending_b_);
    samples_.add("split_ratio", (pending_i_ + pending_w_) / pending_b_);
    pending_i_ = pending_w_ = pending_b_ = -1;
  }

  Json per_phase(const std::string& series, double scale) const;

  std::string name_;
  std::unique_ptr<StageTimer> timer_;
  int64_t blocks_ = 1;  // repeated blocks of the module: ops_per_block = ops / blocks
  Series samples_;
  std::map<std::string, std::map<std::string, std::int64_t>> ops_by_name_;  // by phase, from the last count
  double pending_i_ = -1, pending_w_ = -1, pending_b_ = -1;
};

// {"F": med(series/F) · scale, ...} over the phases that have the series.
Json PathBench::per_phase(const std::string& series, double scale) const {
  Json out = Json::object();
  for (const char* phase : kPhases) {
    const std::string name = series + "/" + phase;
    if (samples_.has(name)) out[phase] = samples_.median(name) * scale;
  }
  return out;
}

Json PathBench::result() const {
  Json r;
  const double f = samples_.median("forward_ms"), i = samples_.median("stage1_ms"),
               w = samples_.median("stage2_ms"), b = samples_.median("fused_ms");
  // The headline ratios are the medians of the per-repetition ratios (each repetition's I, W and B timed side by
  // side), so they lie inside the p25-p75 printed next to them; a ratio of the medians need not.
  r["stage1_ratio"] = samples_.has("stage1_ratio") ? samples_.median("stage1_ratio") : i / b;
  r["split_ratio"] = samples_.has("split_ratio") ? samples_.median("split_ratio") : (i + w) / b;
  r["forward_ms"] = f;
  r["stage1_ms"] = i;
  r["stage2_ms"] = w;
  r["fused_ms"] = b;
  r["split_overhead_ms"] = i + w - b;
  r["host_ms"] = per_phase("host_ms", 1.0);
  r["host_overhead_us"] = per_phase("host_overhead_us", 1.0);
  r["blocks"] = blocks_;
  r["ops_per_block"] = per_phase("ops", 1.0 / static_cast<double>(blocks_));
  if (!ops_by_name_.empty()) r["ops_by_name"] = ops_by_name_;
  const double ai = samples_.median("accumulate/stage1_ms"), aw = samples_.median("accumulate/stage2_ms"),
               ab = samples_.median("accumulate/fused_ms");
  r["accumulate"] = Json{{"stage1_ms", ai}, {"stage2_ms", aw}, {"fused_ms", ab}, {"split_ratio", (ai + aw) / ab}};
  if (samples_.has("device/fused_ms")) {
    const double di = samples_.median("device/stage1_ms"), dw = samples_.median("device/stage2_ms"),
                 db = samples_.median("device/fused_ms");
    r["device_timed"] = Json{{"forward_ms", samples_.median("device/forward_ms")},
                             {"stage1_ms", di},
                             {"stage2_ms", dw},
                             {"fused_ms", db},
                             {"split_ratio", (di + dw) / db}};
  } else {
    r["device_timed"] = nullptr;  // on the CPU the synced times are the device times
  }
  if (samples_.has("batched_w_ms")) {
    const double batched = samples_.median("batched_w_ms"), separate = samples_.median("separate_w_ms");
    r["batched_w_speedup"] = separate / batched;
    r["batched_w_ms"] = batched;
    r["separate_w_ms"] = separate;
  }
  r["parameters"] = timer_->parameter_count();
  // Matrix-product FLOPs only (attention scores and element-wise work left out): forward 2·P per token for a
  // stack of P weights applied to every token, I and W 2·P each. Meaningful for the LLaMa stacks, whose
  // parameters are all GEMM weights but the norms.
  if (tokens_ > 0) {
    const double gemm = 2.0 * static_cast<double>(timer_->parameter_count()) * static_cast<double>(tokens_);
    r["forward_tflops"] = gemm / (f * 1e9);
    r["stage1_tflops"] = gemm / (i * 1e9);
    r["stage2_tflops"] = gemm / (w * 1e9);
    r["fused_tflops"] = 2.0 * gemm / (b * 1e9);
  }
  r["spread"] = spread(samples_);
  // The largest transient footprint of one phase (F, I, W, B or a batched W): bytes allocated at its peak
  // above those allocated when it began -- activations and gradients, not the weights of the paths.
  if (timer_->peak_above_phase_start_bytes() >= 0) {
    r["peak_above_phase_start_bytes"] = timer_->peak_above_phase_start_bytes();
  }
  return r;
}

std::map<std::string, at::Tensor> PathBench::accumulated_gradients() {
  std::map<std::string, at::Tensor> v;
  if (!module_) return v;
  timer_->weight_batch(2, /*batched=*/false);
  for (const auto& item : module_->named_parameters()) {
    const at::Tensor holder = autograd::gradient_holder(item.value());
    if (holder.grad().defined()) v["accumulated " + item.key() + ".grad"] = holder.grad().to(at::kFloat);
  }
  return v;
}

/// The fast path against the general one on the same weights and data (compare_values): the largest relative
/// difference over the output, the input gradient and every weight gradient, from no gradients (values()) and
/// accumulating (accumulated_gradients(): the W that adds into an existing .grad, accumulating_w_compared of them).
/// The two compute the same function with other kernels, so they agree to the dtype's rounding:
/// within 3e-2 in bfloat16 (2^-8 per rounding, accumulated over the blocks), 1e-4 in float32.
Json compare_paths(PathBench& fast, PathBench& general, at::ScalarType dtype) {
  const double tolerance = dtype == at::kBFloat16 ? 3e-2 : 1e-4;
  std::map<std::string, at::Tensor> a = fast.timer().values(), b = general.timer().values();
  const std::map<std::string, at::Tensor> a_accumulated = fast.accumulated_gradients(),
                                          b_accumulated = general.accumulated_gradients();
  a.insert(a_accumulated.begin(), a_accumulated.end());
  b.insert(b_accumulated.begin(), b_accumulated.end());
  const ValueComparison c = compare_values(a, b);
  const ValueComparison accumulated = compare_values(a_accumulated, b_accumulated);
  return Json{{"compared", c.compared},         {"max_relative_difference", c.max_relative_difference},
              {"worst", c.worst},               {"tolerance", tolerance},
              {"not_compared", c.not_compared}, {"ok", c.within(tolerance) && accumulated.compared > 0},
              {"accumulating_w_compared", accumulated.compared}};
}

template <typename L>
std::unique_ptr<PathBench> make_llama(const std::string& name, const SplitConfig& c, const at::Tensor& input) {
  torch::manual_seed(0);  // same initial weights on both paths
  auto module = std::make_shared<LlamaStack<L>>(c.model);
  auto* raw = module.get();
  auto bench = std::make_unique<PathBench>(
      name, std::make_unique<StageTimer>(module, [raw](const at::Tensor& x) { return raw->forward(x); }, input,
                                         timer_options(c)),
      c.model.layers);
  bench->tokens_ = c.batch * c.seq;
  bench->module_ = module;
  return bench;
}

std::unique_ptr<PathBench> make_conv(const SplitConfig& c) {
  torch::manual_seed(0);
  ConvStack module(c.conv_channels, c.conv_layers);
  auto* raw = module.get();
  auto input = torch::randn({c.batch, c.conv_channels, c.conv_size, c.conv_size}).to(tensor_options(c));
  return std::make_unique<PathBench>(
      "general_conv",
      std::make_unique<StageTimer>(module.ptr(), [raw](const at::Tensor& x) { return raw->forward(x); }, input,
                                   timer_options(c)),
      c.conv_layers);
}

Json config_json(const SplitConfig& c, const std::vector<std::string>& paths) {
  return Json{{"dim", c.model.dim}, {"ffn", c.model.ffn}, {"heads", c.model.heads}, {"kv_heads", c.model.kv_heads},
              {"layers", c.model.layers}, {"seq", c.seq}, {"batch", c.batch}, {"repeats", c.repeats},
              {"warmup", c.warmup}, {"threads", c.threads}, {"clock", c.clock}, {"precision", to_string(c.precision)},
              {"dtype", c.precision == Precision::kFloat32   ? "float32"
                        : c.precision == Precision::kFloat64 ? "float64"
                                                             : "bfloat16"},
              {"master_weights", mixed_precision(c)}, {"device", c.device}, {"paths", paths},
              {"batched_w", c.batched_w}, {"micro_batches", c.micro_batches}, {"conv", c.conv},
              {"conv_channels", c.conv_channels}, {"conv_size", c.conv_size}, {"conv_layers", c.conv_layers},
              {"torch_version", TORCH_VERSION}};
}

// The headline numbers a split JSON must hold. `positive`: times, ratios and counts (> 0); otherwise the keys that
// are a difference of two timings (host_overhead_us: host time minus the time inside operators), which load or a
// coarse clock can make negative: they must only be finite numbers.
std::vector<std::string> required_keys(const Json& json, bool positive) {
  std::vector<std::string> keys;
  const Json config = json.value("config", Json::object());
  for (const std::string& path : kPathNames) {
    if (!json.contains(path)) continue;
    for (const char* key : {"stage1_ratio", "split_ratio", "forward_ms", "stage1_ms", "stage2_ms", "fused_ms",
                            "accumulate/stage2_ms", "accumulate/fused_ms", "accumulate/split_ratio"}) {
      keys.push_back(path + "/" + key);
    }
    for (const char* phase : kPhases) {
      if (!positive) {
        keys.push_back(path + "/host_overhead_us/" + phase);
        continue;
      }
      for (const char* key : {"host_ms", "ops_per_block"}) keys.push_back(path + "/" + key + "/" + phase);
    }
    if (!positive) continue;
    if (config.value("device", "cpu") == "cuda") keys.push_back(path + "/device_timed/split_ratio");
    if (config.value("batched_w", false)) keys.push_back(path + "/batched_w_speedup");
  }
  if (!positive) return keys;
  for (const char* key : {"dim", "layers", "seq", "batch", "repeats", "threads"}) {
    keys.push_back(std::string("config/") + key);
  }
  return keys;
}

// The paths --paths asks for (general_conv only with --conv), built on the same input.
std::vector<std::unique_ptr<PathBench>> make_paths(const SplitConfig& c, const std::vector<std::string>& names) {
  torch::manual_seed(1);
  const at::Tensor input = torch::randn({c.batch, c.seq, c.model.dim}).to(tensor_options(c));
  std::vector<std::unique_ptr<PathBench>> paths;
  for (const std::string& name : names) {
    if (name == "fast") paths.push_back(make_llama<FastLayers>("fast", c, input));
    if (name == "general") paths.push_back(make_llama<GeneralLayers>("general", c, input));
    if (name == "general_conv") paths.push_back(make_conv(c));
  }
  return paths;
}

// Every repetition runs every variant of every path, in an order that rotates with the repetition. A signal
// (SIGINT, SIGTERM) ends the run after the repetition in progress. Returns the timed repetitions done.
int run_repetitions(const SplitConfig& c, std::vector<std::unique_ptr<PathBench>>& paths,
                    const InterruptGuard& interrupts) {
  using Variant = std::function<void(PathBench&, bool)>;
  const bool by_name = c.ops_by_name;
  std::vector<Variant> variants = {
      [](PathBench& p, bool rec) { p.split(rec, /*existing=*/false); },
      [](PathBench& p, bool rec) { p.fused(rec, /*existing=*/false); },
      [](PathBench& p, bool rec) { p.split(rec, /*existing=*/true); },
      [](PathBench& p, bool rec) { p.fused(rec, /*existing=*/true); },
      [by_name](PathBench& p, bool rec) { p.counted(rec, by_name); }};
  if (c.device == "cuda") variants.push_back([](PathBench& p, bool rec) { p.back_to_back(rec); });
  if (c.batched_w) {
    const int m = c.micro_batches;
    variants.push_back([m](PathBench& p, bool rec) { p.weight_batch(m, /*batched=*/true, rec); });
    variants.push_back([m](PathBench& p, bool rec) { p.weight_batch(m, /*batched=*/false, rec); });
  }
  std::cerr << "split: " << c.warmup << " warmup + " << c.repeats << " repetitions, " << c.threads << " threads\n";
  const int total = c.warmup + c.repeats;
  const int every = std::max(1, total / 10);  // about ten progress lines
  const auto started = std::chrono::steady_clock::now();
  for (int r = 0; r < total; ++r) {
    if (r % every == 0) {
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - started;
      std::cerr << "split: " << metrics::format_progress("repetition", r + 1, total, elapsed.count()) << "\n";
    }
    const bool record = r >= c.warmup;
    for (auto& path : paths) {
      for (std::size_t v = 0; v < variants.size(); ++v) variants[(v + r) % variants.size()](*path, record);
    }
    if (interrupts.received() != 0) return std::max(0, r + 1 - c.warmup);
  }
  return c.repeats;
}

// A path's result (name, its JSON) and one phase of it (kPhases[phase]; -1 for the headline table).
struct PathRow {
  std::string name;
  const Json* r = nullptr;
  int phase = -1;
};

// The headline table (one row per path) and the phase table (one row per path and phase): table-only Reporters
// over the results already in the JSON.
void print_tables(const SplitConfig& c, const Json& out, const std::vector<std::string>& names) {
  using Row = PathRow;
  auto num = [](const char* key, int digits) {
    return [key, digits](const Row& p) { return fmt_num((*p.r)[key].get<double>(), digits); };
  };
  auto spread = [](const char* key) {
    return [key](const Row& p) {
      const Json& s = (*p.r)["spread"][key];
      return fmt_num(s["p25"].get<double>(), 3) + "-" + fmt_num(s["p75"].get<double>(), 3);
    };
  };
  std::vector<Column<Row>> headline{
      cell<Row>("path", [](const Row& p) { return p.name; }), cell<Row>("F ms", num("forward_ms", 2)),
      cell<Row>("I ms", num("stage1_ms", 2)),  cell<Row>("W ms", num("stage2_ms", 2)),
      cell<Row>("B ms", num("fused_ms", 2)),   cell<Row>("I/B", num("stage1_ratio", 3)),
      cell<Row>("I/B p25-p75", spread("stage1_ratio")), cell<Row>("(I+W)/B", num("split_ratio", 3)),
      cell<Row>("(I+W)/B p25-p75", spread("split_ratio")),
      cell<Row>("(I+W)/B accumulating",
                [](const Row& p) { return fmt_num((*p.r)["accumulate"]["split_ratio"].get<double>(), 3); })};
  if (c.batched_w) {
    headline.push_back(cell<Row>("batched W x" + std::to_string(c.micro_batches), [](const Row& p) {
      return fmt_num((*p.r)["batched_w_speedup"].get<double>(), 3) + "x";
    }));
  }
  // A phase's number: r[key][phase] (the synced times are r[synced key of the phase]).
  auto at = [](const char* key, int digits) {
    return [key, digits](const Row& p) { return fmt_num((*p.r)[key][kPhases[p.phase]].get<double>(), digits); };
  };
  static const char* const synced[] = {"forward_ms", "stage1_ms", "stage2_ms", "fused_ms"};
  const Reporter<Row> phases({cell<Row>("path", [](const Row& p) { return p.name; }),
                              cell<Row>("phase", [](const Row& p) { return std::string(kPhases[p.phase]); }),
                              cell<Row>("synced ms",
                                        [](const Row& p) { return fmt_num((*p.r)[synced[p.phase]].get<double>()); }),
                              cell<Row>("host ms", at("host_ms", 2)),
                              cell<Row>("device-timed ms",
                                        [](const Row& p) {
                                          const Json& d = (*p.r)["device_timed"];
                                          return d.is_null() ? "n/a" : fmt_num(d[synced[p.phase]].get<double>());
                                        }),
                              cell<Row>("host overhead us", at("host_overhead_us", 0)),
                              cell<Row>("ops/block", at("ops_per_block", 1))});
  std::vector<Row> paths, path_phases;
  for (const std::string& name : names) {
    paths.push_back({name, &out[name]});
    for (int k = 0; k < 4; ++k) path_phases.push_back({name, &out[name], k});
  }
  print_table(std::cout, Reporter<Row>(std::move(headline)).table(paths));
  print_table(std::cout, phases.table(path_phases));
}

void check_written(const std::string& file) {
  // Re-read the file as a consumer would and check every headline number.
  const Json back = read_json(file);
  const std::vector<std::string> positive = required_keys(back, /*positive=*/true);
  const std::vector<std::string> finite = required_keys(back, /*positive=*/false);
  auto problems = check_numbers(back, positive, /*positive=*/true);
  for (auto& p : check_numbers(back, finite, /*positive=*/false)) problems.push_back(std::move(p));
  if (back.contains("fast_vs_general") && !back["fast_vs_general"].value("ok", false)) {
    problems.push_back("fast_vs_general: the fast and general paths disagree beyond their tolerance");
  }
  for (const auto& p : problems) std::cerr << "check failed: " << file << ": " << p << "\n";
  if (!problems.empty()) throw CLI::RuntimeError(2);
  std::cout << "check: " << positive.size() << " keys present and positive, " << finite.size()
            << " finite (host overheads: a difference of two timings)\n";
}

void run_split(const SplitConfig& c) {
  at::set_num_threads(c.threads);
  torch::set_default_dtype(caffe2::TypeMeta::Make<float>());
  if (c.model.dim % c.model.heads != 0 || c.model.heads % c.model.kv_heads != 0 || (c.model.dim / c.model.heads) % 2) {
    throw CLI::ValidationError("split", "--dim must be a multiple of --heads (even head dim), --heads of --kv-heads");
  }
  std::vector<std::string> names;
  for (const std::string& name : name_list(c.paths, kPathNames, "path")) {
    if (name != "general_conv" || c.conv) names.push_back(name);
  }
  if (names.empty()) throw CLI::ValidationError("--paths", "no path left to time (general_conv needs --conv)");
  const double load_start = cli::warn_if_loaded("split", "--threads 1 --clock cpu");
  SplitConfig cfg = c;
  cfg.model.max_seq = c.seq;
  if (cfg.model.ffn <= 0) cfg.model.ffn = (8 * cfg.model.dim / 3 + 31) / 32 * 32;  // LLaMa's rule: 512 -> 1376
  std::vector<std::unique_ptr<PathBench>> paths = make_paths(cfg, names);
  // Ctrl-C / SIGTERM: the repetition in progress ends; the medians of those done are reported and written, and
  // the command exits 130 / 143 (twobp/runtime/interrupt.h).
  InterruptGuard interrupts;
  cfg.repeats = run_repetitions(cfg, paths, interrupts);
  if (interrupts.received() != 0) {
    std::cerr << "split: interrupted by " << interrupts.received_name() << " after " << cfg.repeats << " of "
              << c.repeats << " timed repetitions" << (cfg.repeats > 0 ? "; reporting those" : ": nothing to report")
              << "\n";
    if (cfg.repeats == 0) throw CLI::RuntimeError(interrupts.exit_status());
  }

  Json out;
  for (const auto& path : paths) out[path->name()] = path->result();
  if (names.size() >= 2 && names[0] == "fast" && names[1] == "general") {
    out["fast_vs_general"] = compare_paths(*paths[0], *paths[1], tensor_options(c).dtype().toScalarType());
  }
  Json config = config_json(cfg, names);
  if (c.device == "cuda") {
    // Peak bytes held by live tensors on GPU 0 over the whole run (all paths' weights, activations, gradients).
    std::int64_t peak = memory::allocated(tensor_options(c).device()).peak;
    for (const auto& path : paths) peak = std::max(peak, path->timer().peak_bytes());
    config["peak_allocated_bytes"] = peak;
  }
  if (interrupts.received() != 0) config["interrupted"] = interrupts.received_name();  // "repeats": those done
  config["load_average_start"] = load_start;
  config["load_average_end"] = metrics::load_average();
  out["config"] = config;

  std::cout << "dim " << cfg.model.dim << ", ffn " << cfg.model.ffn << ", layers " << cfg.model.layers << ", seq "
            << c.seq << ", batch " << c.batch << ", " << to_string(c.precision) << ", " << c.threads << " threads, " << c.clock
            << " clock, median of " << cfg.repeats << " (load " << fmt_num(load_start) << " -> "
            << fmt_num(metrics::load_average()) << ")\n";
  print_tables(c, out, names);
  if (out.contains("fast_vs_general")) {
    const Json& agree = out["fast_vs_general"];
    std::cout << "fast vs general path: max relative difference "
              << fmt_num(agree["max_relative_difference"].get<double>(), 3) << " over "
              << agree["compared"].get<int>() << " values, " << agree["accumulating_w_compared"].get<int>()
              << " of them accumulating W (" << agree["worst"].get<std::string>() << "), tolerance "
              << agree["tolerance"].get<double>() << ": " << (agree["ok"].get<bool>() ? "ok" : "DIFFER") << "\n";
  }
  if (!c.json.empty()) {
    cli::write_json(c.json, out);
    std::cout << "wrote " << c.json << "\n";
    if (c.check) check_written(c.json);
  }
  if (interrupts.received() != 0) throw CLI::RuntimeError(interrupts.exit_status());
}

}  // namespace

void add_split_command(CLI::App& app) {
  auto cfg = std::make_shared<SplitConfig>();
  CLI::App* sub = app.add_subcommand("split", "Cost of the 2BP split (I, W) against the fused backward (B)");
  count_option(sub, "--dim", cfg->model.dim, "Model width");
  sub->add_option("--ffn", cfg->model.ffn, "SwiGLU hidden width (default: 8/3 dim rounded up to a multiple of 32)")
      ->check(cli::number_in(1, cli::kMaxCount));
  count_option(sub, "--heads", cfg->model.heads, "Attention heads");
  count_option(sub, "--kv-heads", cfg->model.kv_heads, "Key/value heads (grouped-query attention)");
  count_option(sub, "--layers", cfg->model.layers, "Blocks in the stage");
  count_option(sub, "--seq", cfg->seq, "Sequence length");
  count_option(sub, "--batch", cfg->batch, "Micro-batch size");
  count_option(sub, "--repeats", cfg->repeats, "Timed repetitions (medians over these)");
  count_option(sub, "--warmup", cfg->warmup, "Untimed repetitions first", 0, cli::kMaxCount);
  count_option(sub, "--threads", cfg->threads, "at::set_num_threads", 1, cli::kMaxRanks);
  sub->add_flag("--batched-w", cfg->batched_w, "Also time W of --micro-batches at once vs one by one");
  count_option(sub, "--microbatches,--micro-batches", cfg->micro_batches, "Micro-batches for --batched-w", 1, 64);
  sub->add_flag("--conv,!--no-conv", cfg->conv, "Include the general-path conv net (general_conv)")
      ->capture_default_str();
  count_option(sub, "--conv-channels", cfg->conv_channels, "Conv net channels");
  count_option(sub, "--conv-size", cfg->conv_size, "Conv net image height and width");
  count_option(sub, "--conv-layers", cfg->conv_layers, "Conv net residual blocks");
  sub->add_option("--clock", cfg->clock,
                  "wall, or cpu: process CPU time, steadier on a busy machine but only meaningful with --threads 1")
      ->capture_default_str()
      ->check(CLI::IsMember({"wall", "cpu"}));
  sub->add_option("--json", cfg->json, "Write the results to this JSON file")->check(cli::writable_file());
  sub->add_option("--device", cfg->device, "cpu or cuda (GPU 0)")->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option_function<std::string>(
         "--dtype", [cfg](const std::string& dtype) { cfg->precision = parse_precision(dtype); },
         "fp32; bf16: mixed precision (bfloat16 compute, float32 master weights and gradients); bf16-pure: "
         "everything in bfloat16 (default fp32)")
      ->check(cli::one_spelling(parse_precision, "fp32, bf16, bf16-pure or fp64"));
  sub->add_option("--paths", cfg->paths,
                  "all, or paths separated by commas: fast, general, general_conv (only the fast path: --paths fast "
                  "builds no general-path stack)")
      ->check(names_in(kPathNames, "path"))
      ->capture_default_str();
  sub->add_flag("--ops-by-name", cfg->ops_by_name, "Also write each phase's top-level ATen operators by name");
  sub->add_flag("--check", cfg->check, "Re-read the --json file and fail unless every headline number is there")
      ->needs(sub->get_option("--json"));
  sub->callback([cfg] { run_split(*cfg); });
}

}  // namespace twobp::bench
