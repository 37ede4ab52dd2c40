// `twobp_bench split`: what the 2BP split of the backward costs on one pipeline stage, against the fused backward.
//
// Setup: one middle stage (stage_index 1 of 3: its input needs a gradient, no loss), fed a fixed input x and a
// fixed output gradient dY. Paths, all in the same run:
//   fast          LLaMa-style stack of twobp::nn::Linear / RMSNorm layers (weight work via WeightGradStore)
//   general       the same stack with torch::nn::Linear and an op-composed RMSNorm (autograd-graph split)
//   general_conv  residual conv-BN-ReLU-conv stack (general path), unless --no-conv
//
// Every repetition runs, per path, these variants back to back (the order rotates with the repetition so that
// drift and cache state affect all variants alike); parameter gradients are set to none before each variant,
// untimed, so that B and W both create .grad the way the first micro-batch of a step does:
//   split:  t_F = time(Stage::forward)   t_I = time(Stage::backward_input(dY))   t_W = time(Stage::backward_weight({mb}))
//   fused:  t_F = time(Stage::forward)   t_B = time(Stage::backward(dY))
// Each phase has its own timer, so t_I is exactly t(F + I) - t(F) of the same repetition.
// With med(.) the median over --repeats repetitions (after --warmup untimed ones):
//   forward_ms   = med(t_F)                    over the forward of both variants
//   stage1_ms    = t(I) = med(t_I)             stage 1: input gradient only
//   stage2_ms    = t(W) = med(t_W)             stage 2: weight gradients of one micro-batch
//   fused_ms     = t(B) = med(t_B)             ordinary backprop (input and weight gradients)
//   stage1_ratio = t(I) / t(B)                 ~0.5 when GEMMs dominate: how early stage 1 can hand dX upstream
//   split_ratio  = (t(I) + t(W)) / t(B)        1.0 = the split costs nothing extra
//   split_overhead_ms = t(I) + t(W) - t(B)
// Times are wall-clock; --clock cpu takes process CPU time instead (steadier on a shared machine, meaningful
// only with --threads 1).
// "spread" gives min/p25/median/p75/max of every timed series and of the per-repetition ratios
// t_I/t_B and (t_I + t_W)/t_B.
//
// --batched-w (the paper's batched backward-p2), with m = --micro-batches, two more variants per repetition:
//   F and I of micro-batches 0..m-1 untimed, then
//   batched:   batched_w_ms  = med(time(Stage::backward_weight({0, ..., m-1})))   one concatenated GEMM per layer
//   separate:  separate_w_ms = med(time(Stage::backward_weight({0}); ...; Stage::backward_weight({m-1})))
//   batched_w_speedup = separate_w_ms / batched_w_ms           > 1: batching W pays off
// (The general path has no batched W: its speedup only shows the per-call overhead.)

#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "twobp_cli.h"
#include "bench_models.h"
#include "commands.h"
#include "twobp/config.h"
#include "twobp/precision.h"
#include "twobp/stage.h"

#if TWOBP_HAVE_NCCL  // the CUDA toolkit was found: the caching allocator's statistics are reachable
#include <c10/cuda/CUDACachingAllocator.h>
#endif

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
  std::string clock = "wall";
  std::string device = "cpu";  // cpu | cuda
  // fp32 or bf16-pure. Mixed precision (bf16: bfloat16 compute, float32 masters) is refused by --dtype's check
  // (split_precision) until the bench times it: float32 masters gathering each W's bfloat16 gradient.
  Precision precision = Precision::kFloat32;
};

at::TensorOptions tensor_options(const SplitConfig& c) {
  return at::TensorOptions()
      .dtype(compute_dtype(c.precision))
      .device(c.device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
}

/// One path under test: a stage on a module, with its fixed input and output gradient.
class PathBench {
 public:
  PathBench(std::string name, std::shared_ptr<torch::nn::Module> module, StageForward forward, at::Tensor input,
            Clock clock)
      : name_(std::move(name)), module_(std::move(module)), input_(std::move(input)), clock_(clock) {
    module_->to(input_.device(), input_.is_floating_point() ? input_.scalar_type() : at::kFloat);
    cuda_ = input_.is_cuda();
    StageOptions options;
    options.stage_index = 1;
    options.num_stages = 3;
    stage_ = std::make_unique<Stage>(module_, std::move(forward), options);
    // The output gradient has the output's shape; one untimed forward tells it.
    at::Tensor out = stage_->forward(0, input_);
    stage_->reset();
    grad_output_ = at::randn_like(out);
  }

  const std::string& name() const { return name_; }
  const Series& samples() const { return samples_; }
  int64_t parameter_count() const {
    int64_t n = 0;
    for (const auto& p : twobp::unique_tensors(module_->parameters())) n += p.numel();
    return n;
  }

  // GPU work is asynchronous: each timed phase ends with a device synchronisation, so a phase's time is its own.
  // On a GPU each phase also records the allocator's peak above what was allocated when it began (see memory).
  template <typename Fn>
  double timed(Fn&& fn) {
#if TWOBP_HAVE_NCCL
    std::int64_t base = 0;
    if (cuda_) {
      const auto before = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
      base = before.allocated_bytes[0].current;
      run_peak_bytes() = std::max(run_peak_bytes(), before.allocated_bytes[0].peak);
      c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    }
#endif
    const double ms = time_ms(
        [&] {
          fn();
          if (cuda_) torch::cuda::synchronize();
        },
        clock_);
#if TWOBP_HAVE_NCCL
    if (cuda_) {
      const std::int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
      run_peak_bytes() = std::max(run_peak_bytes(), peak);
      peak_above_start_ = std::max(peak_above_start_, peak - base);
    }
#endif
    return ms;
  }

  /// The peak bytes allocated on GPU 0 over the whole run (all paths), kept across the per-phase resets above.
  static std::int64_t& run_peak_bytes() {
    static std::int64_t peak = 0;
    return peak;
  }

  /// F, I and W of micro-batch 0 once, untimed: the output, the input gradient (if any) and every weight
  /// gradient by name, in float32 -- to compare the paths, which start from the same weights and data.
  std::map<std::string, at::Tensor> values() {
    module_->zero_grad(/*set_to_none=*/true);
    std::map<std::string, at::Tensor> v;
    v["output"] = stage_->forward(0, input_).detach().to(at::kFloat);
    const at::Tensor grad_input = stage_->backward_input(0, grad_output_);
    if (grad_input.defined()) v["input gradient"] = grad_input.to(at::kFloat);
    stage_->backward_weight({0});
    for (const auto& item : module_->named_parameters()) {
      if (item.value().grad().defined()) v[item.key() + ".grad"] = item.value().grad().to(at::kFloat);
    }
    module_->zero_grad(/*set_to_none=*/true);
    return v;
  }

  void split(bool record) {
    module_->zero_grad(/*set_to_none=*/true);
    const double f = timed([&] { stage_->forward(0, input_); });
    const double i = timed([&] { stage_->backward_input(0, grad_output_); });
    const double w = timed([&] { stage_->backward_weight({0}); });
    if (!record) return;
    samples_.add("forward_ms", f);
    samples_.add("stage1_ms", i);
    samples_.add("stage2_ms", w);
    pending_i_ = i;
    pending_w_ = w;
    pair_ratios();
  }

  void fused(bool record) {
    module_->zero_grad(/*set_to_none=*/true);
    const double f = timed([&] { stage_->forward(0, input_); });
    const double b = timed([&] { stage_->backward(0, grad_output_); });
    if (!record) return;
    samples_.add("forward_ms", f);
    samples_.add("fused_ms", b);
    pending_b_ = b;
    pair_ratios();
  }

  /// W of m micro-batches in one call (batched) or in m calls (separate); F and I untimed.
  void weight_batch(int m, bool batched, bool record) {
    module_->zero_grad(/*set_to_none=*/true);
    std::vector<int> mbs(m);
    std::iota(mbs.begin(), mbs.end(), 0);
    for (int mb : mbs) stage_->forward(mb, input_);
    for (int mb : mbs) stage_->backward_input(mb, grad_output_);
    const double w = timed([&] {
      if (batched) {
        stage_->backward_weight(mbs);
      } else {
        for (int mb : mbs) stage_->backward_weight({mb});
      }
    });
    if (record) samples_.add(batched ? "batched_w_ms" : "separate_w_ms", w);
  }

  Json result() const {
    Json r;
    const double f = samples_.median("forward_ms"), i = samples_.median("stage1_ms"),
                 w = samples_.median("stage2_ms"), b = samples_.median("fused_ms");
    r["stage1_ratio"] = i / b;
    r["split_ratio"] = (i + w) / b;
    r["forward_ms"] = f;
    r["stage1_ms"] = i;
    r["stage2_ms"] = w;
    r["fused_ms"] = b;
    r["split_overhead_ms"] = i + w - b;
    if (samples_.has("batched_w_ms")) {
      const double batched = samples_.median("batched_w_ms"), separate = samples_.median("separate_w_ms");
      r["batched_w_speedup"] = separate / batched;
      r["batched_w_ms"] = batched;
      r["separate_w_ms"] = separate;
    }
    r["parameters"] = parameter_count();
    // Matrix-product FLOPs only (attention scores and element-wise work left out): forward 2·P per token for a
    // stack of P weights applied to every token, I and W 2·P each. Meaningful for the LLaMa stacks, whose
    // parameters are all GEMM weights but the norms.
    if (tokens_ > 0) {
      const double gemm = 2.0 * static_cast<double>(parameter_count()) * static_cast<double>(tokens_);
      r["forward_tflops"] = gemm / (f * 1e9);
      r["stage1_tflops"] = gemm / (i * 1e9);
      r["stage2_tflops"] = gemm / (w * 1e9);
      r["fused_tflops"] = 2.0 * gemm / (b * 1e9);
    }
    r["spread"] = samples_.spread();
    // The largest transient footprint of one phase (F, I, W, B or a batched W): bytes allocated at its peak
    // above those allocated when it began -- activations and gradients, not the weights of the paths.
    if (cuda_) r["peak_above_phase_start_bytes"] = peak_above_start_;
    return r;
  }

 private:
  // Per-repetition ratios once both the split and the fused variant of a repetition are in.
  void pair_ratios() {
    if (pending_b_ < 0 || pending_i_ < 0) return;
    samples_.add("stage1_ratio", pending_i_ / pending_b_);
    samples_.add("split_ratio", (pending_i_ + pending_w_) / pending_b_);
    pending_i_ = pending_w_ = pending_b_ = -1;
  }

  std::string name_;
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<Stage> stage_;
  at::Tensor input_, grad_output_;
  Clock clock_;
  bool cuda_ = false;
  Series samples_;

 public:
  int64_t tokens_ = 0;  ///< tokens per micro-batch, for the TFLOP/s of the LLaMa stacks (0: not reported)

 private:
  double pending_i_ = -1, pending_w_ = -1, pending_b_ = -1;
  std::int64_t peak_above_start_ = 0;
};

/// The fast path against the general one on the same weights and data: the largest relative difference (norm of
/// the difference over norm of the general path's value) over the output, the input gradient and every weight
/// gradient. The two compute the same function with other kernels, so they agree to the dtype's rounding:
/// within 3e-2 in bfloat16 (2^-8 per rounding, accumulated over the blocks), 1e-4 in float32.
Json compare_paths(PathBench& fast, PathBench& general, at::ScalarType dtype) {
  const auto a = fast.values(), b = general.values();
  const double tolerance = dtype == at::kBFloat16 ? 3e-2 : 1e-4;
  double worst = 0.0;
  std::string worst_name;
  int compared = 0;
  std::vector<std::string> missing;
  for (const auto& [name, value] : b) {
    auto it = a.find(name);
    if (it == a.end() || it->second.sizes() != value.sizes()) {
      missing.push_back(name);
      continue;
    }
    const double scale = value.norm().item<double>();
    const double diff = (it->second - value).norm().item<double>() / (scale > 0 ? scale : 1.0);
    ++compared;
    if (!(diff <= worst)) {  // NaN counts as the worst
      worst = diff;
      worst_name = name;
    }
  }
  return Json{{"compared", compared},
              {"max_relative_difference", worst},
              {"worst", worst_name},
              {"tolerance", tolerance},
              {"not_compared", missing},
              {"ok", compared > 0 && missing.empty() && worst <= tolerance}};
}

template <typename L>
std::unique_ptr<PathBench> make_llama(const std::string& name, const SplitConfig& c, const at::Tensor& input) {
  torch::manual_seed(0);  // same initial weights on both paths
  auto module = std::make_shared<LlamaStack<L>>(c.model);
  auto* raw = module.get();
  auto bench = std::make_unique<PathBench>(name, module, [raw](const at::Tensor& x) { return raw->forward(x); },
                                           input, parse_clock(c.clock));
  bench->tokens_ = c.batch * c.seq;
  return bench;
}

std::unique_ptr<PathBench> make_conv(const SplitConfig& c) {
  torch::manual_seed(0);
  ConvStack module(c.conv_channels, c.conv_layers);
  auto* raw = module.get();
  auto input = torch::randn({c.batch, c.conv_channels, c.conv_size, c.conv_size}).to(tensor_options(c));
  return std::make_unique<PathBench>("general_conv", module.ptr(),
                                     [raw](const at::Tensor& x) { return raw->forward(x); }, input,
                                     parse_clock(c.clock));
}

Json config_json(const SplitConfig& c) {
  return Json{{"dim", c.model.dim},
              {"ffn", c.model.ffn},
              {"heads", c.model.heads},
              {"kv_heads", c.model.kv_heads},
              {"layers", c.model.layers},
              {"seq", c.seq},
              {"batch", c.batch},
              {"repeats", c.repeats},
              {"warmup", c.warmup},
              {"threads", c.threads},
              {"clock", c.clock},
              {"dtype", to_string(c.precision)},
              {"device", c.device},
              {"batched_w", c.batched_w},
              {"micro_batches", c.micro_batches},
              {"conv", c.conv},
              {"conv_channels", c.conv_channels},
              {"conv_size", c.conv_size},
              {"conv_layers", c.conv_layers},
              {"torch_version", TORCH_VERSION}};
}

std::vector<std::string> required_keys(const Json& json) {
  std::vector<std::string> keys;
  for (const char* path : {"fast", "general", "general_conv"}) {
    if (std::string(path) == "general_conv" && !json.contains(path)) continue;
    for (const char* key : {"stage1_ratio", "split_ratio", "forward_ms", "stage1_ms", "stage2_ms", "fused_ms"}) {
      keys.push_back(std::string(path) + "/" + key);
    }
    if (json.value("config", Json::object()).value("batched_w", false)) {
      keys.push_back(std::string(path) + "/batched_w_speedup");
    }
  }
  for (const char* key : {"dim", "layers", "seq", "batch", "repeats", "threads"}) {
    keys.push_back(std::string("config/") + key);
  }
  return keys;
}

void run_split(const SplitConfig& c) {
  at::set_num_threads(c.threads);
  torch::set_default_dtype(caffe2::TypeMeta::Make<float>());
  if (c.model.dim % c.model.heads != 0 || c.model.heads % c.model.kv_heads != 0 || (c.model.dim / c.model.heads) % 2) {
    throw CLI::ValidationError("split", "--dim must be a multiple of --heads (even head dim), --heads of --kv-heads");
  }
  const double load_start = load_average();
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && load_start > cores) {
    std::cerr << "split: warning: load average " << fmt_num(load_start) << " on " << cores
              << " cores; other processes take cores from the timed threads, see the spread (or use --threads 1 "
                 "--clock cpu)\n";
  }

  LlamaConfig model = c.model;
  model.max_seq = c.seq;
  if (model.ffn <= 0) model.ffn = (8 * model.dim / 3 + 31) / 32 * 32;  // LLaMa's rule: 512 -> 1376
  SplitConfig cfg = c;
  cfg.model = model;
  torch::manual_seed(1);
  const at::Tensor input = torch::randn({c.batch, c.seq, c.model.dim}).to(tensor_options(c));
  std::vector<std::unique_ptr<PathBench>> paths;
  paths.push_back(make_llama<FastLayers>("fast", cfg, input));
  paths.push_back(make_llama<GeneralLayers>("general", cfg, input));
  if (c.conv) paths.push_back(make_conv(cfg));

  using Variant = std::function<void(PathBench&, bool)>;
  std::vector<Variant> variants = {[](PathBench& p, bool rec) { p.split(rec); },
                                   [](PathBench& p, bool rec) { p.fused(rec); }};
  if (c.batched_w) {
    const int m = c.micro_batches;
    variants.push_back([m](PathBench& p, bool rec) { p.weight_batch(m, /*batched=*/true, rec); });
    variants.push_back([m](PathBench& p, bool rec) { p.weight_batch(m, /*batched=*/false, rec); });
  }

  std::cerr << "split: " << c.warmup << " warmup + " << c.repeats << " repetitions, " << c.threads << " threads\n";
  for (int r = 0; r < c.warmup + c.repeats; ++r) {
    const bool record = r >= c.warmup;
    for (auto& path : paths) {
      for (std::size_t v = 0; v < variants.size(); ++v) variants[(v + r) % variants.size()](*path, record);
    }
  }

  Json out;
  for (const auto& path : paths) out[path->name()] = path->result();
  out["fast_vs_general"] = compare_paths(*paths[0], *paths[1], tensor_options(c).dtype().toScalarType());
  Json config = config_json(cfg);
#if TWOBP_HAVE_NCCL
  if (c.device == "cuda") {
    // Peak bytes held by live tensors on GPU 0 over the whole run (all paths' weights, activations, gradients).
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    config["peak_allocated_bytes"] = std::max(PathBench::run_peak_bytes(), stats.allocated_bytes[0].peak);
  }
#endif
  config["load_average_start"] = load_start;
  config["load_average_end"] = load_average();
  out["config"] = config;

  std::vector<std::vector<std::string>> rows = {{"path", "F ms", "I ms", "W ms", "B ms", "I/B", "I/B p25-p75",
                                                 "(I+W)/B", "(I+W)/B p25-p75"}};
  if (c.batched_w) rows[0].push_back("batched W x" + std::to_string(c.micro_batches));
  for (const auto& path : paths) {
    const Json& r = out[path->name()];
    const Json& s = r["spread"];
    std::vector<std::string> row = {
        path->name(),
        fmt_num(r["forward_ms"].get<double>()),
        fmt_num(r["stage1_ms"].get<double>()),
        fmt_num(r["stage2_ms"].get<double>()),
        fmt_num(r["fused_ms"].get<double>()),
        fmt_num(r["stage1_ratio"].get<double>(), 3),
        fmt_num(s["stage1_ratio"]["p25"].get<double>(), 3) + "-" + fmt_num(s["stage1_ratio"]["p75"].get<double>(), 3),
        fmt_num(r["split_ratio"].get<double>(), 3),
        fmt_num(s["split_ratio"]["p25"].get<double>(), 3) + "-" + fmt_num(s["split_ratio"]["p75"].get<double>(), 3)};
    if (c.batched_w) row.push_back(fmt_num(r["batched_w_speedup"].get<double>(), 3) + "x");
    rows.push_back(row);
  }
  std::cout << "dim " << cfg.model.dim << ", ffn " << cfg.model.ffn << ", layers " << cfg.model.layers << ", seq " << c.seq
            << ", batch " << c.batch << ", " << c.threads << " threads, " << c.clock << " clock, median of " << c.repeats
            << " (load " << fmt_num(load_start) << " -> " << fmt_num(load_average()) << ")\n";
  print_table(std::cout, rows);
  const Json& agree = out["fast_vs_general"];
  std::cout << "fast vs general path: max relative difference "
            << fmt_num(agree["max_relative_difference"].get<double>(), 3) << " over " << agree["compared"].get<int>()
            << " values (" << agree["worst"].get<std::string>() << "), tolerance "
            << agree["tolerance"].get<double>() << ": " << (agree["ok"].get<bool>() ? "ok" : "DIFFER") << "\n";

  if (c.json.empty()) return;
  write_json(c.json, out);
  std::cout << "wrote " << c.json << "\n";
  if (c.check) {
    // Re-read the file as a consumer would and check every headline number.
    const Json back = read_json(c.json);
    auto problems = check_numbers(back, required_keys(back), /*positive=*/true);
    if (!back.value("fast_vs_general", Json::object()).value("ok", false)) {
      problems.push_back("fast_vs_general: the fast and general paths disagree beyond their tolerance");
    }
    for (const auto& p : problems) std::cerr << "check failed: " << c.json << ": " << p << "\n";
    if (!problems.empty()) throw CLI::RuntimeError(2);
    std::cout << "check: " << required_keys(back).size() << " keys present and positive\n";
  }
}

// --dtype's check: a precision as every program spells it (twobp::parse_precision), of those this bench times.
// HOOK (issue 57): mixed precision lands here -- accept Precision::kMixedBFloat16 once PathBench keeps float32
// masters beside its bfloat16 module.
CLI::Validator split_precision() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        Precision p;
        try {
          p = parse_precision(text);
        } catch (const std::exception& e) {
          return e.what();
        }
        if (p == Precision::kMixedBFloat16) {
          return "split does not time mixed precision (bf16: bfloat16 compute, float32 masters) yet; --dtype "
                 "bf16-pure times everything in bfloat16 (what --dtype bf16 meant here before)";
        }
        text = to_string(p);
        return std::string();
      },
      "fp32 or bf16-pure");
}

}  // namespace

void add_split_command(CLI::App& app) {
  auto cfg = std::make_shared<SplitConfig>();
  CLI::App* sub = app.add_subcommand("split", "Cost of the 2BP split (I, W) against the fused backward (B)");
  sub->add_option("--dim", cfg->model.dim, "Model width")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--ffn", cfg->model.ffn, "SwiGLU hidden width (default: 8/3 dim rounded up to a multiple of 32)")
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--heads", cfg->model.heads, "Attention heads")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--kv-heads", cfg->model.kv_heads, "Key/value heads (grouped-query attention)")
      ->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--layers", cfg->model.layers, "Blocks in the stage")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--seq", cfg->seq, "Sequence length")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--batch", cfg->batch, "Micro-batch size")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--repeats", cfg->repeats, "Timed repetitions (medians over these)")
      ->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--warmup", cfg->warmup, "Untimed repetitions first")->capture_default_str()
      ->check(cli::number_in(0, cli::kMaxCount));
  sub->add_option("--threads", cfg->threads, "at::set_num_threads")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxRanks));
  sub->add_flag("--batched-w", cfg->batched_w, "Also time W of --micro-batches at once vs one by one");
  sub->add_option("--microbatches,--micro-batches", cfg->micro_batches, "Micro-batches for --batched-w")
      ->capture_default_str()
      ->check(cli::number_in(1, 64));
  sub->add_flag("--conv,!--no-conv", cfg->conv, "Include the general-path conv net (general_conv)")
      ->capture_default_str();
  sub->add_option("--conv-channels", cfg->conv_channels, "Conv net channels")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--conv-size", cfg->conv_size, "Conv net image height and width")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--conv-layers", cfg->conv_layers, "Conv net residual blocks")->capture_default_str()
      ->check(cli::number_in(1, cli::kMaxCount));
  sub->add_option("--clock", cfg->clock,
                  "wall, or cpu: process CPU time, steadier on a busy machine but only meaningful with --threads 1")
      ->capture_default_str()
      ->check(CLI::IsMember({"wall", "cpu"}));
  sub->add_option("--json", cfg->json, "Write the results to this JSON file")->check(cli::writable_file());
  sub->add_option("--device", cfg->device, "cpu or cuda (GPU 0)")->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option_function<std::string>(
         "--dtype", [cfg](const std::string& dtype) { cfg->precision = parse_precision(dtype); },
         "fp32 or bf16-pure (weights and activations in bfloat16; mixed precision, bf16, is not timed here yet) "
         "(default fp32)")
      ->check(split_precision());
  sub->add_flag("--check", cfg->check, "Re-read the --json file and fail unless every headline number is there")
      ->needs(sub->get_option("--json"));
  sub->callback([cfg] { run_split(*cfg); });
}

}  // namespace twobp::bench
