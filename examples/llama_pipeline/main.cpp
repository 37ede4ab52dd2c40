// llama_pipeline: trains a LLaMa-like model with pipeline parallelism and (optionally) 2-stage backpropagation.
//
//   llama_pipeline --model tiny --ranks 2 --schedule 1f1b --steps 50           # 2 ranks as threads, LocalTransport
//   mpirun -n 4 llama_pipeline --model small --schedule zb-h1 --device cuda    # one rank per process, NCCL/MPI
//   torchrun --nproc-per-node 4 --no-python llama_pipeline --device cuda ...   # the same without MPI (TCPStore)
//   llama_pipeline --model 7b --ranks 4 --dry-run --json plan.json             # sizes and memory, nothing allocated
//   mpirun -n 8 llama_pipeline --dp 2 --device cuda ...                        # 2 replicas of a 4-rank pipeline
//   llama_pipeline --pack --seq-len-warmup 10 --steps 50                       # packed documents, length warm-up
//   llama_pipeline --recompute --schedule zb-h1                                # activation recomputation
//   llama_pipeline --model 7b --ranks 4 --schedule zb-v --dry-run --gpu-memory-gb 80   # will it fit?
//   llama_pipeline --schedule zb-h2 --memory-limit-gb 0.5                      # memory-bounded 2BP
//
// `--help` lists every option by group with its default and range, `--version` the twobp commit and LibTorch. Every
// option is checked when parsed (examples/common/twobp_cli.h: one line naming it, exit status 2), output paths
// before the run; a CPU run that clearly cannot fit in the machine's memory is refused before allocating. For the
// smallest program to start from, see examples/minimal.
//
// Ranks: under an MPI launcher (detected by twobp::launched_by_mpi_launcher) in a build with MPI every process is
// one rank (MpiEnvironment); under torchrun or srun -- or mpirun in a build without MPI -- the ranks come from the
// launcher's environment (twobp::launch_env) and meet at a c10d::TCPStore served by rank 0 at
// MASTER_ADDR:MASTER_PORT (StoreTransport). In both cases --ranks is ignored and GPUs talk over NCCL. Otherwise
// --ranks P ranks run as threads of this process over a LocalTransport group.
// The pipeline has P * --chunks-per-rank stages; the model is split into that many chunks balanced by compute
// (or by --partition "3,3,2,0"), and each rank builds only its own chunks.
//
// Data parallelism: --dp D trains D replicas of a P-rank pipeline on D * P ranks (threads: --ranks P gives P, and
// D * P threads run; under a launcher P = world size / D). World rank r is pipeline rank r % P of replica r / P
// (twobp::ParallelLayout: a replica's stages are adjacent ranks, so they share a node). Every step reads one
// global batch of D * --microbatches * --micro-batch-size sequences; replica d trains on the d-th share of it, and
// gradients are averaged over the replicas (overlapped with W), so losses match a single pipeline with D times
// the micro-batches. Checkpoints hold one copy per stage (replica 0 writes) under global tensor names, and resume
// with any D and any pipeline layout (--ranks, --schedule, --chunks-per-rank, --partition).
//
// Devices and precision: --device cuda puts rank r's chunks on GPU (local rank mod device count). Activations cross
// ranks through the transport's device (CPU for Local/MPI: each chunk's forward moves its input to the GPU and its
// output back, differentiably). --dtype bf16 is mixed precision (twobp::MixedPrecisionOptions): the chunks
// compute in bfloat16 and activations travel in bfloat16, while the optimizer steps float32 master weights whose
// float32 gradients sum every micro-batch's; checkpoints hold the masters. --dtype bf16-pure keeps everything,
// AdamW state included, in bfloat16. The loss is computed in float32 either way. Both mean the same on CPUs,
// where bfloat16 matrix products are slower than float32 (use them there to try, not for speed). With --dp the
// replicas average the masters' float32 gradients.
//
// Steps: --steps N is the length of the run and the horizon of the learning-rate schedule (linear warm-up for
// --warmup-steps, then cosine decay to 10% of --lr at step N). --stop-after K ends the run after step K (and
// checkpoints it when --checkpoint-dir is given); a later --resume continues to N with identical losses, because the
// batch of step s depends only on (--seed, s) and the checkpoint holds the weights and the AdamW state.
//
// Optimizer: AdamW (betas 0.9, 0.95), over the float32 masters with --dtype bf16. --zero 1 shards its state over
// the --dp replicas (twobp::ShardedOptimizer, ZeRO-1): each replica steps its share and broadcasts the updated
// parameters; the JSON's "optimizer_state_bytes" is the most any rank held (measured after the last step).
// Checkpoints gather the whole state and any --zero / --dp resumes from them.
//
// Evaluation: --eval-every N holds out the corpus's last --eval-fraction (never trained on) and, every N steps and
// after the last, runs --eval-batches global batches of it through twobp::Pipeline::evaluate (forward only, the
// chunks in eval mode): the validation loss and perplexity go to the progress line and the JSON ("eval_loss",
// "eval_perplexity" on evaluated steps).
//
// Energy: every step's joules (the whole job's: NVML per GPU, RAPL per node where powercap is readable;
// twobp/metrics/energy.h) and joules per token go to the progress line and the JSON ("energy_j", "j_per_token";
// null, with "energy_note" saying why, where the hardware has no readable counter).
//
// Sequences: --pack treats the token --doc-separator as the end of a document; attention stays within a document,
// rotary positions restart at each one, and no target predicts across documents. Positions and document ids cross
// every stage boundary beside the hidden state (twobp::NamedTensors, without gradients); the loss mask reaches the
// last stage directly from the data. --seq-len-warmup S grows the sequence length from short to --seq-len over S
// steps (twobp::data::warmup_seq_len); shapes then change every step, so senders announce them.

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include <unistd.h>  // sysconf: the machine's memory

#include "twobp/checkpoint.h"
#include "twobp/config.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/memory.h"
#include "twobp/metrics/metrics.h"
#include "twobp/models/llama.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/mpi_launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/schedule.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/local.h"
#include "twobp/transport/mpi.h"
#include "twobp/transport/nccl.h"
#include "twobp/transport/store.h"
#include "twobp/version.h"
#include "twobp_cli.h"  // examples/common: option checks shared with twobp_bench

// The example sticks to the public API; this is its one-line check helper.
#define TWOBP_CHECK(cond, type, ...)                        \
  do {                                                      \
    if (!(cond)) throw type(fmt::format(__VA_ARGS__));      \
  } while (false)

namespace llm = twobp::models;
namespace ck = twobp::checkpoint;

namespace {

struct Args {
  std::string model = "tiny";
  llm::LlamaDims dims;  // sizes replacing the preset's (--dim ... --vocab)
  std::string schedule = "1f1b";
  bool two_bp = true;
  int microbatches = 4;
  int micro_batch_size = 2;
  int seq_len = 0;  // 0: the model's default
  int steps = 20;
  int stop_after = 0;  // 0: run to --steps
  int warmup_steps = -1;  // -1: steps / 10
  double lr = 3e-3;
  double weight_decay = 0.1;
  double clip = 1.0;
  std::string device = "cpu";
  std::string dtype = "fp32";
  std::string data;
  std::string checkpoint_dir;
  int checkpoint_every = 0;
  bool resume = false;
  std::string trace;
  double timeout_s = 300;
  int stages = 2;
  int dp = 1;  // data-parallel replicas
  int max_pending_w = 0;  // memory-bounded 2BP: 0 = no limit
  double memory_limit_gb = 0;  // memory-bounded 2BP in GiB of tensor memory per rank: 0 = no limit
  double gpu_memory_gb = 0;    // dry run: say whether each rank fits this much (0: do not judge)
  bool pack = false;      // packed documents: positions and document mask cross every stage boundary
  int doc_separator = 10;  // the token that ends a document ('\n' for the byte-level corpus)
  int seq_len_warmup = 0;  // steps over which the sequence length grows to --seq-len (0: none)
  bool recompute = false;  // activation recomputation on every chunk
  int chunks_per_rank = 0;  // 0: the schedule's default
  std::string schedule_file;
  std::string dump_schedule;  // write the run's schedule here (.csv: PyTorch's compute_only form) and go on
  std::string partition;
  bool dry_run = false;
  std::string json;
  std::string powercap_root = twobp::energy::EnergyOptions{}.powercap_root;  // RAPL zones (energy on CPUs)
  uint64_t seed = 1234;
  int zero = 0;                // 1: AdamW state sharded over the data-parallel replicas (ZeRO-1)
  std::string on_nonfinite = "stop";  // a NaN/Inf loss or gradient: stop (error) or skip the update
  int eval_every = 0;          // evaluate on the held-out split every N steps (0: never)
  int eval_batches = 2;        // global batches per evaluation
  double eval_fraction = 0.1;  // the corpus's tail held out for evaluation when --eval-every > 0
  // Set by main() from the command line as given:
  std::vector<std::string> ignored;  // options that have no effect in this run (warned about)
  bool ranks_given = false;          // --ranks (--stages) on the command line (ignored under a launcher)
};

/// The training precision of the memory estimates (twobp::models::training_precision) for --dtype.
std::string training_precision_name(const Args& a) {
  return a.dtype == "bf16" ? "bf16-mixed" : a.dtype == "bf16-pure" ? "bf16" : "fp32";
}

/// Everything every rank agrees on before the first step.
struct Plan {
  Args args;
  llm::LlamaConfig config;
  int world_size = 1;  // pipeline ranks of one replica (pp); the job has dp * world_size ranks
  int dp = 1;
  int64_t seq_len = 0;
  twobp::Schedule schedule;
  llm::Partition partition;
  at::ScalarType dtype = at::kFloat;  // what the chunks compute in (and activations travel in)
  bool mixed_precision = false;       // bf16 compute with float32 masters (--dtype bf16)
  // What a checkpoint must match to be resumed (the model and its training), and the layout it was written with
  // (recorded, not checked: checkpoints load by global tensor name into any pp, dp, schedule and partition).
  ck::CheckpointConfig checkpoint_config;
  ck::CheckpointConfig checkpoint_layout;
};

/// `world_size`: the pipeline ranks of one replica.
Plan make_plan(const Args& args, int world_size) {
  Plan plan;
  plan.args = args;
  plan.world_size = world_size;
  plan.dp = args.dp;
  plan.config = llm::with_dims(llm::config_by_name(args.model), args.dims);
  plan.seq_len = args.seq_len > 0 ? args.seq_len : plan.config.max_seq_len;
  plan.schedule = twobp::resolve_schedule({args.schedule, args.schedule_file, args.chunks_per_rank}, world_size,
                                          args.microbatches,
                                          args.two_bp ? twobp::BackwardMode::kSplit : twobp::BackwardMode::kStandard);
  plan.partition = llm::make_partition(plan.config, plan.schedule.num_stages, plan.seq_len, args.partition);
  plan.dtype = args.dtype == "fp32" ? at::kFloat : at::kBFloat16;
  plan.mixed_precision = args.dtype == "bf16";
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

// ---- Dry run: sizes and memory from formulas; nothing is allocated ----

/// What the memory formulas need to know of the run (twobp::models::estimate_memory).
llm::MemoryPlanOptions memory_options(const Plan& p) {
  llm::MemoryPlanOptions mo;
  mo.micro_batch_size = p.args.micro_batch_size;
  mo.seq_len = p.seq_len;
  mo.precision = llm::training_precision(training_precision_name(p.args));
  mo.recompute = p.args.recompute;
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
  j["precision"] = mo.precision.name;
  j["recompute"] = mo.recompute;
  if (budget > 0) j["gpu_memory_gb"] = p.args.gpu_memory_gb;
  j["memory_formula"] =
      "twobp::models::memory_model + twobp::simulate_peak_memory: base = parameters x (compute + master + AdamW "
      "bytes); per stage F keeps chunk_activation_bytes (recompute: the input), I keeps chunk_pending_weight_bytes "
      "until W, the first W or B allocates the gradients; message buffers not counted";
  fmt::print("model {}: {} parameters ({:.3f} B), {} stages over {} ranks, schedule {} ({}), partition {} "
             "(imbalance {:.3f}), precision {}{}, micro-batch {} x {} tokens, m = {}\n",
             cfg.name, llm::parameter_count(cfg), llm::parameter_count(cfg) / 1e9, S, p.world_size, p.schedule.name,
             p.schedule.backward == twobp::BackwardMode::kSplit ? "2BP" : "fused backward", p.partition.layout(),
             p.partition.imbalance(), mo.precision.name, mo.recompute ? ", recompute" : "", mo.micro_batch_size,
             mo.seq_len, p.schedule.num_micro_batches);
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

// ---- Training ----

struct StepRecord {
  int step;
  double loss;
  double tokens_per_s;
  double grad_norm;
  double lr;
  double peak_memory_bytes;  // max over the pipeline's ranks of StepResult::peak_memory_bytes
  std::optional<double> energy_j;  // the whole job's, this step (twobp/metrics/energy.h); nullopt: not measured
  std::optional<double> j_per_token;
  std::optional<double> eval_loss;  // the held-out split's mean loss after this step's update, when evaluated
  bool skipped = false;             // --on-nonfinite skip dropped this step's update
};

/// AdamW over this rank's parameters: a ShardedOptimizer over the replicas with --zero 1, over this rank alone
/// (no group: it owns every parameter, a plain AdamW) otherwise, so both go through one code path.
class Optimizer {
 public:
  Optimizer(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& options, twobp::Transport* replicas,
            bool shard, twobp::Duration timeout)
      : adamw_(std::move(params), shard ? replicas : nullptr,
               [options](std::vector<at::Tensor> owned) -> std::unique_ptr<torch::optim::Optimizer> {
                 return std::make_unique<torch::optim::AdamW>(std::move(owned), options);
               },
               timeout) {}
  void set_lr(double lr) {
    torch::optim::Optimizer* o = adamw_.local();
    if (o == nullptr) return;  // a replica that owns no parameter
    for (auto& group : o->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  void step() { adamw_.step(); }
  /// Every parameter's state as a checkpoint holds it (collective over the replicas when sharded).
  ck::NamedTensors state(const ck::NamedTensors& named) { return adamw_.gathered_adamw_state(named); }
  /// Weights and this rank's share of the state from a checkpoint holding every parameter's.
  void restore(const ck::NamedTensors& loaded, const ck::NamedTensors& named) {
    ck::restore(loaded, named, nullptr);
    adamw_.restore_adamw_state(loaded, named);
  }
  /// Bytes of the optimizer state this rank holds.
  int64_t state_bytes() const { return adamw_.state_bytes(); }

 private:
  twobp::ShardedOptimizer adamw_;
};

/// What rank 0 reports and the threads share.
struct Shared {
  std::mutex mutex;
  std::vector<StepRecord> records;
  std::vector<twobp::Trace> traces;  // last step, per rank (threads mode)
  int64_t resumed_from = 0;
  std::string energy_source, energy_note;  // rank 0's meter ("nvml", "rapl" or ""), and why it has none
  std::vector<double> optimizer_state_bytes;  // by world rank, after the last step
};

/// The model inputs and targets of this rank for one replica's share of a global batch (empty where the rank owns
/// neither end of the pipeline).
struct RankBatch {
  twobp::NamedTensors inputs, targets;
};

RankBatch rank_batch(const Args& a, const twobp::data::Batch& batch, int64_t share, int64_t rows, int64_t len,
                     bool owns_first, bool owns_last) {
  const at::Tensor ids = batch.inputs.narrow(0, share, rows).narrow(1, 0, len);
  const at::Tensor next = batch.targets.narrow(0, share, rows).narrow(1, 0, len);
  RankBatch out;
  if (a.pack) {
    if (owns_first) out.inputs = llm::packed_inputs(ids, a.doc_separator);
    if (owns_last) out.targets = llm::packed_targets(ids, next, a.doc_separator);
  } else {
    if (owns_first) out.inputs = twobp::NamedTensors(ids);
    if (owns_last) out.targets = twobp::NamedTensors(next);
  }
  return out;
}

/// `tokens`: the training split; `held_out`: the evaluation split (empty without --eval-every).
void train_rank(const Plan& p, twobp::Transport& world, c10::Device device, const std::vector<uint16_t>& tokens,
                const std::vector<uint16_t>& held_out, Shared& shared) {
  const Args& a = p.args;
  const auto timeout = twobp::Duration(static_cast<int64_t>(a.timeout_s * 1000));
  // The pipeline of this rank's replica, and the group of the same stages in every replica (dp > 1).
  twobp::ParallelGroups groups(world, p.dp, timeout);
  twobp::Transport& transport = groups.pipeline();
  const int rank = transport.rank();  // in the pipeline
  const bool reports = world.rank() == 0;
  const ck::DataParallelCheckpoint replicas{p.dp, groups.replica(), groups.data_parallel()};
  const int last = p.schedule.num_stages - 1;

  // Build only this rank's chunks.
  std::vector<twobp::PipelineChunk> chunks;
  ck::NamedTensors named;
  std::vector<at::Tensor> params;
  const c10::Device wire = transport.device();
  for (int s : p.schedule.stages_of(rank)) {
    llm::LlamaChunk chunk(p.config, p.partition.chunks[s], a.seed);
    // Mixed precision: built in float32; the Pipeline keeps float32 masters and converts the chunk to bfloat16.
    chunk->to(device, p.mixed_precision ? at::kFloat : p.dtype);
    for (auto& t : ck::module_tensors(*chunk)) named.push_back(t);
    for (auto& t : chunk->parameters()) params.push_back(t);
    const bool is_last = s == last;
    std::shared_ptr<llm::LlamaChunkImpl> impl = chunk.ptr();
    // Compute on `device`; activations travel on the transport's device (no-op when equal).
    if (a.pack) {
      // Several tensors cross each boundary: the hidden state and, without gradients, positions and doc ids.
      chunks.push_back({s, impl, [impl, device, wire, is_last](const twobp::NamedTensors& in) {
                          twobp::NamedTensors here;
                          for (const auto& [name, t] : in) here.add(name, t.to(device));
                          twobp::NamedTensors out = impl->forward(here);
                          if (!is_last) {
                            for (auto& e : out) e.tensor = e.tensor.to(wire);
                          }
                          return out;
                        }});
    } else {
      chunks.push_back({s, impl, [impl, device, wire, is_last](const at::Tensor& x) {
                          at::Tensor y = impl->forward(x.to(device));
                          return is_last ? y : y.to(wire);
                        }});
    }
  }
  for (auto& chunk : chunks) chunk.recompute = a.recompute;
  twobp::PipelineOptions po;
  po.timeout = timeout;
  const int64_t mbs = a.micro_batch_size, seq = p.seq_len, dim = p.config.dim;
  const auto dtype = p.dtype;
  // Fixed shapes give every boundary a spec; with a sequence-length warm-up they change from step to step, so the
  // senders announce them instead (PipelineOptions::activation_spec).
  if (a.seq_len_warmup == 0 && a.pack) {
    po.boundary_spec = [=](int) {
      return twobp::BoundarySpec{{{mbs, seq, dim}, dtype, llm::kHidden},
                                 {{mbs, seq}, at::kLong, llm::kPositions, false},
                                 {{mbs, seq}, at::kLong, llm::kDocIds, false}};
    };
  } else if (a.seq_len_warmup == 0) {
    po.activation_spec = [=](int) { return twobp::TensorSpec{{mbs, seq, dim}, dtype}; };
  }
  if (a.pack) {
    po.loss = llm::masked_cross_entropy_loss;
  } else {
    po.loss = [](const at::Tensor& logits, const at::Tensor& targets) {
      return llm::cross_entropy_loss(logits, targets.to(logits.device()));
    };
  }
  po.data_parallel.group = groups.data_parallel();
  po.max_pending_weight_micro_batches = a.max_pending_w;
  // Tensor memory of the device the chunks compute on, recorded every step (and bounded with --memory-limit-gb).
  // Not where rank threads share a GPU: its allocator statistics are the whole process's (the Pipeline refuses).
  const bool shared_device = !device.is_cpu() && transport.ranks_sharing_device() > 1;
  TWOBP_CHECK(!shared_device || a.memory_limit_gb <= 0, twobp::UsageError,
              "--memory-limit-gb: {} rank threads share {}, whose memory statistics are the whole process's; run one "
              "rank per GPU (fewer --ranks, or a launcher)",
              transport.ranks_sharing_device(), device.str());
  po.record_memory = !shared_device;
  po.memory_device = device;
  po.memory_limit_bytes = static_cast<int64_t>(a.memory_limit_gb * 1024.0 * 1024.0 * 1024.0);
  if (p.mixed_precision) po.mixed_precision.compute_dtype = at::kBFloat16;
  twobp::Pipeline pipeline(p.schedule, std::move(chunks), transport, po);

  // Each tensor once: with tied embeddings the head chunk lists its table under two names, and AdamW would
  // step it twice. With mixed precision the optimizer and the checkpoints hold the float32 masters.
  params = pipeline.parameters();
  for (auto& entry : named) entry.second = pipeline.master_weight(entry.second);
  Optimizer optimizer(params, torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(a.weight_decay),
                      groups.data_parallel(), a.zero == 1, timeout);
  int start = 0;
  if (a.resume) {
    // By global name: the parameters of this rank's chunks, wherever the checkpoint's layout had them.
    auto loaded = ck::load_checkpoint_by_name(a.checkpoint_dir, p.checkpoint_config, ck::state_of(named),
                                              fmt::format("rank {} (replica {})", rank, groups.replica()));
    optimizer.restore(loaded.tensors, named);
    start = static_cast<int>(loaded.step);
    if (reports) {
      shared.resumed_from = start;
      fmt::print("resuming from step {} of {} ({})\n", start, a.steps, a.checkpoint_dir);
    }
  }
  // One global batch per step, the same for every --dp; replica d trains on its d-th share.
  const int64_t replica_batch = a.microbatches * mbs;
  twobp::data::BatchSampler sampler(tokens, seq, p.dp * replica_batch, a.seed);
  // Evaluation: the same --eval-batches global batches of the held-out split every time, full length.
  std::optional<twobp::data::BatchSampler> eval_sampler;
  if (a.eval_every > 0) eval_sampler.emplace(held_out, seq, p.dp * replica_batch, a.seed);
  const int end = a.stop_after > 0 ? std::min(a.stop_after, a.steps) : a.steps;
  const bool owns_first = p.schedule.stage_to_rank[0] == rank;
  const bool owns_last = p.schedule.stage_to_rank[last] == rank;
  const auto t0 = std::chrono::steady_clock::now();
  // Energy of the device the chunks compute on (NVML) or of the node's CPUs (RAPL), summed over the job.
  twobp::energy::EnergyOptions energy_options;
  energy_options.powercap_root = a.powercap_root;
  energy_options.ranks_sharing_device = device.is_cpu() ? 1 : transport.ranks_sharing_device();
  twobp::energy::RankEnergy rank_energy(device, twobp::energy::first_rank_on_node(world), energy_options);
  if (reports) {
    std::lock_guard<std::mutex> lock(shared.mutex);
    shared.energy_source = rank_energy.source();
    shared.energy_note = rank_energy.note();
  }

  for (int step = start; step < end; ++step) {
    const auto ts = std::chrono::steady_clock::now();
    const std::optional<double> e0 = rank_energy.share();
    const double lr = learning_rate(a, step);
    optimizer.set_lr(lr);
    pipeline.zero_grad();
    // The step's sequence length (shorter during --seq-len-warmup): a prefix of the full-length windows, so the
    // batch of a step still depends only on (--seed, step).
    const int64_t len = twobp::data::warmup_seq_len(seq, step, a.seq_len_warmup);
    const double tokens_per_step = static_cast<double>(p.dp * replica_batch * len);
    const int64_t share = groups.replica() * replica_batch;
    const RankBatch batch = rank_batch(a, sampler.batch(step), share, replica_batch, len, owns_first, owns_last);
    auto result = pipeline.step(batch.inputs, batch.targets);
    // The gate: no optimizer step on a NaN or Inf loss or gradient (--on-nonfinite stop: NumericalError naming the
    // step and stages; skip: this step's update is dropped on every rank), gradients clipped to --clip (0: not).
    const bool updated = pipeline.ready_for_optimizer(
        step + 1, a.on_nonfinite == "skip" ? twobp::NonFinitePolicy::kSkipStep : twobp::NonFinitePolicy::kStop,
        a.clip);
    if (updated) optimizer.step();
    const double norm = pipeline.last_gradient_check().norm;
    // The mean loss lives on the last stage's ranks; all-reduces bring the global batch's to everyone.
    const double loss = pipeline.mean_loss(result);
    // Held-out loss of the updated weights (Pipeline::evaluate: forward only, the chunks in eval mode).
    std::optional<double> eval_loss;
    if (eval_sampler && ((step + 1) % a.eval_every == 0 || step + 1 == end)) {
      double sum = 0.0;
      for (int k = 0; k < a.eval_batches; ++k) {
        const RankBatch held = rank_batch(a, eval_sampler->batch(k), share, replica_batch, seq, owns_first, owns_last);
        sum += pipeline.evaluate(held.inputs, held.targets);
      }
      eval_loss = sum / a.eval_batches;
    }
    // Each pipeline rank's peak in its own slot; the sum over ranks then holds every rank's.
    at::Tensor peaks = at::zeros({transport.world_size()}, at::kDouble);  // host values, reduced on the host
    peaks[rank] = static_cast<double>(result.peak_memory_bytes);
    transport.all_reduce_sum(peaks, timeout);
    const double peak_memory = peaks.max().item<double>();
    const std::optional<double> e1 = rank_energy.share();
    const std::optional<double> energy_j = twobp::energy::job_energy(
        world, e0 && e1 ? std::optional<double>(*e1 - *e0) : std::nullopt, timeout);
    std::optional<double> j_per_token;
    if (energy_j) j_per_token = twobp::metrics::per_item(*energy_j, tokens_per_step);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - ts).count();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tokens_per_s = twobp::metrics::per_second(tokens_per_step, secs);
    if (reports) {
      const double remaining = elapsed / (step - start + 1) * (end - step - 1);
      fmt::print("step {:>5}/{} | loss {:.4f} | {}{}grad norm {:.3f} | lr {:.2e} | {:.0f} tok/s | peak {} | "
                 "{}elapsed {:.1f}s | remaining {:.1f}s\n",
                 step + 1, a.steps, loss, updated ? "" : "update skipped (non-finite) | ",
                 eval_loss ? fmt::format("val loss {:.4f} (ppl {:.2f}) | ", *eval_loss, std::exp(*eval_loss)) : "",
                 norm, lr, tokens_per_s,
                 peak_memory < 0 ? std::string("n/a (rank threads share the GPU)")
                                 : fmt::format("{:.1f} MiB", peak_memory / (1024.0 * 1024.0)),
                 j_per_token ? fmt::format("{:.3g} J/tok | ", *j_per_token) : "", elapsed, remaining);
      std::fflush(stdout);
      std::lock_guard<std::mutex> lock(shared.mutex);
      shared.records.push_back(
          {step, loss, tokens_per_s, norm, lr, peak_memory, energy_j, j_per_token, eval_loss, !updated});
    }
    if (!a.trace.empty() && step + 1 == end) {
      // Every rank's trace on every rank (collective), so rank 0 writes them all, threads or processes.
      std::vector<twobp::Trace> traces = twobp::gather_traces(world, result.trace, timeout);
      if (reports) {
        std::lock_guard<std::mutex> lock(shared.mutex);
        shared.traces = std::move(traces);
      }
    }
    const bool periodic = a.checkpoint_every > 0 && (step + 1) % a.checkpoint_every == 0;
    if (!a.checkpoint_dir.empty() && (periodic || step + 1 == end)) {
      ck::NamedTensors state = named;
      auto opt = optimizer.state(named);
      state.insert(state.end(), opt.begin(), opt.end());
      ck::CheckpointConfig config = p.checkpoint_config;
      config.insert(p.checkpoint_layout.begin(), p.checkpoint_layout.end());
      ck::save_checkpoint(a.checkpoint_dir, step + 1, config, state, transport, timeout, replicas);
      if (reports) fmt::print("checkpoint of step {} written to {}\n", step + 1, a.checkpoint_dir);
    }
  }
  // The optimizer state each rank holds (with --zero 1, its share), every world rank's in its slot.
  at::Tensor state_bytes = at::zeros({world.world_size()}, at::kDouble);  // host values, reduced on the host
  state_bytes[world.rank()] = static_cast<double>(optimizer.state_bytes());
  world.all_reduce_sum(state_bytes, timeout);
  if (reports) {
    std::lock_guard<std::mutex> lock(shared.mutex);
    const double* b = state_bytes.data_ptr<double>();
    shared.optimizer_state_bytes.assign(b, b + state_bytes.numel());
  }
}

/// The run's closing lines on rank 0: what was trained, how fast, and which files it wrote.
void print_summary(const std::vector<StepRecord>& records, double wall_s, const std::vector<std::string>& written) {
  if (records.empty()) return;
  double loss_sum = 0;
  std::vector<double> rates;
  for (const StepRecord& r : records) {
    loss_sum += r.loss;
    rates.push_back(r.tokens_per_s);
  }
  std::sort(rates.begin(), rates.end());
  fmt::print("done: {} steps (to step {}) in {:.1f} s | final loss {:.4f} | mean loss {:.4f} | median {:.0f} tok/s\n",
             records.size(), records.back().step + 1, wall_s, records.back().loss, loss_sum / records.size(),
             rates[rates.size() / 2]);
  if (!written.empty()) fmt::print("files written: {}\n", fmt::join(written, ", "));
}

/// The rules between options (each option's own range is checked at parse time: add_options()).
void validate_args(const Args& a) {
  TWOBP_CHECK(!a.resume || !a.checkpoint_dir.empty(), twobp::UsageError, "--resume needs --checkpoint-dir");
}

int run(Args args, int& argc, char**& argv) {
  validate_args(args);
  // Before any model exists: CPU tensor memory is counted per rank from here on (twobp/metrics/memory.h).
  twobp::memory::count_cpu_allocations();
  // Launch: MPI when an MPI launcher started us and MPI is built in; else the launcher's environment (torchrun,
  // srun, mpirun) with a TCPStore rendezvous; else ranks as threads.
  const bool mpi = TWOBP_HAVE_MPI && twobp::launched_by_mpi_launcher();
  const std::optional<twobp::LaunchEnv> launch = mpi ? std::nullopt : twobp::launch_env();
  const bool store = launch.has_value();
#if TWOBP_HAVE_MPI
  std::unique_ptr<twobp::MpiEnvironment> env;
  if (mpi) env = std::make_unique<twobp::MpiEnvironment>(&argc, &argv);
  const int world = mpi ? env->world_size() : store ? launch->world_size : args.dp * args.stages;
  const int my_rank = mpi ? env->rank() : store ? launch->rank : 0;
#else
  const int world = store ? launch->world_size : args.dp * args.stages;
  const int my_rank = store ? launch->rank : 0;
#endif
  TWOBP_CHECK(mpi || store || world <= twobp::cli::kMaxRanks, twobp::UsageError,
              "--dp {} x --ranks {} = {} rank threads, more than the {:g} one process runs; use a launcher", args.dp,
              args.stages, world, twobp::cli::kMaxRanks);
  if (my_rank == 0) {
    for (const std::string& option : args.ignored) fmt::print(stderr, "llama_pipeline: warning: {} ignored\n", option);
    if ((mpi || store) && args.ranks_given) {
      fmt::print(stderr, "llama_pipeline: warning: --ranks ignored: the launcher started {} ranks\n", world);
    }
  }
  const twobp::ParallelLayout layout = twobp::ParallelLayout::of(world, args.dp);  // dp must divide the world
  const Plan plan = make_plan(args, layout.pp);  // model, schedule and partition errors surface here
  if (!args.dump_schedule.empty() && my_rank == 0) {
    const bool csv = args.dump_schedule.size() >= 4 &&
                     args.dump_schedule.compare(args.dump_schedule.size() - 4, 4, ".csv") == 0;
    std::ofstream out(args.dump_schedule);
    out << (csv ? twobp::to_pytorch_csv(plan.schedule) : twobp::dump_schedule(plan.schedule));
    out.close();
    TWOBP_CHECK(out.good(), twobp::IOError, "--dump-schedule: cannot write {}", args.dump_schedule);
    fmt::print("schedule {} written to {}\n", plan.schedule.name, args.dump_schedule);
  }
  if (args.dry_run) return my_rank == 0 ? dry_run(plan) : 0;
  if (args.device == "cpu") check_fits_in_host_memory(plan, !(mpi || store), layout.pipeline_rank(my_rank));

  // Everything that can be checked before a step is checked here, on every rank.
  std::vector<uint16_t> tokens =
      args.data.empty()
          ? twobp::data::ByteTokenizer::encode(twobp::data::builtin_corpus())
          : twobp::data::read_token_file(args.data, static_cast<uint32_t>(std::min<int64_t>(plan.config.vocab_size,
                                                                                            65536)));
  TWOBP_CHECK(!args.data.empty() || plan.config.vocab_size >= twobp::data::ByteTokenizer::kVocabSize,
              twobp::UsageError, "--vocab {}: the built-in corpus is byte-level and needs a vocabulary of at least {} "
              "tokens; give --vocab {} or more, or --data with a token file", plan.config.vocab_size,
              twobp::data::ByteTokenizer::kVocabSize, twobp::data::ByteTokenizer::kVocabSize);
  // --eval-every: the corpus's last --eval-fraction is held out (never trained on) for evaluation.
  std::vector<uint16_t> held_out;
  if (args.eval_every > 0) {
    const auto held = static_cast<std::size_t>(static_cast<double>(tokens.size()) * args.eval_fraction);
    held_out.assign(tokens.end() - static_cast<std::ptrdiff_t>(held), tokens.end());
    tokens.resize(tokens.size() - held);
    TWOBP_CHECK(static_cast<int64_t>(held_out.size()) > plan.seq_len, twobp::UsageError,
                "--eval-fraction {} of {} holds out {} tokens, fewer than one sequence of --seq-len {} + 1; raise it "
                "or shorten --seq-len", args.eval_fraction, args.data.empty() ? "the built-in corpus" : args.data,
                held_out.size(), plan.seq_len);
  }
  TWOBP_CHECK(static_cast<int64_t>(tokens.size()) > plan.seq_len, twobp::UsageError,
              "{} has {} tokens{}, fewer than one sequence of --seq-len {} + 1",
              args.data.empty() ? "the built-in corpus" : args.data, tokens.size(),
              args.eval_every > 0 ? " left for training" : "", plan.seq_len);
  if (args.resume) {
    const auto manifest = ck::read_manifest(args.checkpoint_dir);
    ck::check_config(args.checkpoint_dir, manifest, plan.checkpoint_config);  // any layout: loaded by name
  }
  bool cuda = args.device == "cuda";
  TWOBP_CHECK(!cuda || torch::cuda::is_available(), twobp::UsageError,
              "--device cuda, but no CUDA device is available");
  const int gpus = cuda ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (my_rank == 0) {
    fmt::print("llama_pipeline: model {} ({} parameters), {} ranks ({}) = {} replica(s) x {} pipeline ranks, {} "
               "stages, schedule {} with {}, partition {}, {} micro-batches of {} x {} tokens per replica{}{}, "
               "device {}, dtype {}\n",
               plan.config.name, llm::parameter_count(plan.config), world,
               mpi ? "MPI" : store ? "processes, " + launch->launcher + " + TCPStore" : std::string("threads"),
               layout.dp, layout.pp, plan.schedule.num_stages, plan.schedule.name,
               plan.schedule.backward == twobp::BackwardMode::kSplit ? "2BP" : "fused backward",
               plan.partition.layout(), args.microbatches, args.micro_batch_size, plan.seq_len,
               args.pack ? " (packed documents)" : "",
               args.seq_len_warmup > 0 ? fmt::format(" (length warm-up over {} steps)", args.seq_len_warmup) : "",
               args.device, args.dtype);
  }

  Shared shared;
  shared.traces.resize(world);
  const bool processes = mpi || store;
  torch::set_num_threads(
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, processes ? 1 : world)));
  // Processes: GPUs talk over NCCL (one rank per GPU: twobp::choose_cuda_device); CPUs over MPI, or without MPI
  // through the TCPStore that rank 0 serves (slow; meant for trying the launch, not for speed). Threads: Local.
  twobp::RunRanksOptions launch_options;
  launch_options.thread_ranks = world;
  // Thread ranks on GPUs: rank r's messages stay on its GPU (r mod the device count), like its chunks.
  if (cuda && !processes) {
    for (int r = 0; r < world; ++r) launch_options.local.devices.emplace_back(c10::kCUDA, r % gpus);
  }
  launch_options.process_transport = [&](const twobp::LaunchEnv& l) -> std::shared_ptr<twobp::Transport> {
#if TWOBP_HAVE_MPI
    if (mpi) {
#if TWOBP_HAVE_NCCL
      if (cuda) return std::make_shared<twobp::NcclTransport>(*env);
#endif
      return twobp::mpi_process_transport(*env)(l);
    }
#endif
    auto host = std::make_shared<twobp::StoreTransport>(l);
    if (!cuda) return host;
#if TWOBP_HAVE_NCCL
    twobp::NcclOptions nccl;
    nccl.local_rank = l.local_rank;
    nccl.local_size = l.local_size;
    return std::make_shared<twobp::NcclTransport>(host, nccl);
#else
    TWOBP_CHECK(false, twobp::UsageError, "--device cuda across processes needs the NCCL transport, which this "
                "build of twobp does not have");
    return host;
#endif
  };
#if TWOBP_HAVE_MPI
  if (mpi) launch_options.launch = twobp::mpi_launch_env(*env);
#endif
  const auto run_start = std::chrono::steady_clock::now();
  twobp::run_ranks(launch_options, [&](twobp::Transport& transport) {
    // Compute where the transport's wire is (NCCL), else on a GPU of our own (thread ranks share the GPUs) or CPU.
    const c10::Device device = transport.device().is_cuda() ? transport.device()
                               : cuda && !processes ? c10::Device(c10::kCUDA, transport.rank() % gpus)
                                      : c10::Device(c10::kCPU);
    train_rank(plan, transport, device, tokens, held_out, shared);
  });

  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  if (my_rank != 0) return 0;
  std::vector<std::string> written;
  if (!args.dump_schedule.empty()) written.push_back(args.dump_schedule);
  if (!args.checkpoint_dir.empty() && !shared.records.empty()) written.push_back(args.checkpoint_dir + "/");
  if (!args.trace.empty()) {
    std::ofstream out(args.trace);
    out << twobp::to_chrome_trace(shared.traces);
    out.close();
    TWOBP_CHECK(out.good(), twobp::IOError, "--trace: writing {} failed", args.trace);
    fmt::print("trace of the last step written to {}\n", args.trace);
    written.push_back(args.trace);
  }
  if (!args.json.empty()) {
    nlohmann::json j = config_json(plan);
    j["resumed_from"] = shared.resumed_from;
    j["zero"] = args.zero;
    // Measured: the bytes of AdamW state each rank held after the last step (its max, and every world rank's).
    j["optimizer_state_bytes"] = shared.optimizer_state_bytes.empty()
                                     ? nlohmann::json()
                                     : nlohmann::json(*std::max_element(shared.optimizer_state_bytes.begin(),
                                                                        shared.optimizer_state_bytes.end()));
    j["optimizer_state_bytes_per_rank"] = shared.optimizer_state_bytes;
    auto optional_json = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
    j["energy_source"] = nullptr;  // no meter on rank 0
    if (!shared.energy_source.empty()) j["energy_source"] = shared.energy_source;
    if (!shared.energy_note.empty()) j["energy_note"] = shared.energy_note;
    j["steps"] = nlohmann::json::array();
    if (args.eval_every > 0) {
      j["eval"] = {{"every", args.eval_every}, {"batches", args.eval_batches}, {"fraction", args.eval_fraction},
                   {"held_out_tokens", held_out.size()}};
    }
    for (const auto& r : shared.records) {
      nlohmann::json step{{"step", r.step}, {"loss", r.loss}, {"tokens_per_s", r.tokens_per_s},
                          {"grad_norm", r.grad_norm}, {"lr", r.lr}, {"peak_memory_bytes", r.peak_memory_bytes},
                          {"energy_j", optional_json(r.energy_j)}, {"j_per_token", optional_json(r.j_per_token)}};
      if (r.skipped) step["skipped"] = true;
      if (r.eval_loss) {
        step["eval_loss"] = *r.eval_loss;
        step["eval_perplexity"] = std::exp(*r.eval_loss);
      }
      j["steps"].push_back(step);
    }
    write_json(args.json, j);
    written.push_back(args.json);
  }
  print_summary(shared.records, wall_s, written);
  return 0;
}

/// The options, in groups, each checked at parse time (examples/common/twobp_cli.h); the cross-option rules and
/// the checks that need the model or a file are in validate_args() and run().
void add_options(CLI::App& app, Args& a) {
  namespace cli = twobp::cli;
  // A repeated option takes its last value, so scripts can append overrides to a common command line.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->always_capture_default();
  cli::add_version_flag(app, "llama_pipeline");
  // Upper bounds far above any real run's (a 405B model has 126 blocks of width 16384), low enough that sizes
  // multiplied together stay in range; whether the model then fits is check_fits_in_host_memory()'s question.
  const auto width = cli::number_in(0, 1 << 20, " (0: the model's)");
  const auto few = cli::number_in(0, 4096, " (0: the model's)");
  const auto steps = cli::number_in(1, 1e9), steps_or_none = cli::number_in(0, 1e9, " (0: none)");

  const std::string model = "Model";
  app.add_option("--model", a.model, "Model configuration")->check(CLI::IsMember(llm::config_names()))->group(model);
  app.add_option("--dim", a.dims.dim, "Width replacing the model's (with --layers ... --vocab: a custom model)")
      ->check(width)->group(model);
  app.add_option("--layers", a.dims.layers, "Blocks replacing the model's")->check(few)->group(model);
  app.add_option("--heads", a.dims.heads, "Attention heads replacing the model's")->check(few)->group(model);
  app.add_option("--kv-heads", a.dims.kv_heads, "Key/value heads replacing the model's")->check(few)->group(model);
  app.add_option("--ffn", a.dims.ffn, "MLP width replacing the model's")->check(width)->group(model);
  app.add_option("--vocab", a.dims.vocab, "Vocabulary replacing the model's (the built-in corpus needs >= 256)")
      ->check(width)->group(model);
  app.add_option("--seed", a.seed, "Seed of the weights and the data order")
      ->check(cli::number_in(0, 18446744073709551615.0))->group(model);

  const std::string pipeline = "Pipeline";
  app.add_option("--schedule", a.schedule, "Pipeline schedule")
      ->check(CLI::IsMember(twobp::schedule_names()))->group(pipeline);
  app.add_option("--schedule-file", a.schedule_file,
                 "A schedule file: twobp's text form, or PyTorch's compute_only CSV (*.csv); overrides --schedule, "
                 "keeps its own 2BP mode")
      ->check(CLI::ExistingFile)->group(pipeline);
  app.add_option("--dump-schedule", a.dump_schedule,
                 "Write the run's schedule to this file (*.csv: PyTorch's compute_only form; else twobp's text form)")
      ->check(cli::writable_file())->group(pipeline);
  // Two flags rather than CLI11's "--2bp,!--no-2bp", whose help reads "{false}" as if 2BP were off; applied as
  // parsed, so the last one given wins.
  app.add_flag_callback("--2bp", [&a] { a.two_bp = true; }, "Split the backward into I and W (the default)")
      ->trigger_on_parse()->group(pipeline);
  app.add_flag_callback("--no-2bp", [&a] { a.two_bp = false; }, "One fused backward (standard backprop) instead")
      ->trigger_on_parse()->group(pipeline);
  app.add_option("--ranks,--stages", a.stages,
                 "Pipeline ranks per replica, run as threads when no launcher started the process (a launcher's "
                 "world size decides otherwise)")
      ->check(cli::number_in(1, cli::kMaxRanks))->group(pipeline);
  app.add_option("--dp", a.dp, "Data-parallel replicas of the pipeline (world = dp x pipeline ranks)")
      ->check(cli::number_in(1, cli::kMaxRanks))->group(pipeline);
  app.add_option("--chunks-per-rank", a.chunks_per_rank,
                 "Model chunks per rank (interleaved and V schedules; 0: the schedule's)")
      ->check(cli::number_in(0, cli::kMaxRanks))->group(pipeline);
  app.add_option("--partition", a.partition, "Blocks per chunk, e.g. 3,3,2,0 (default: balanced by compute)")
      ->group(pipeline);
  app.add_option("--microbatches,--micro-batches", a.microbatches, "Micro-batches per step and replica")
      ->check(cli::number_in(1, 4096))->group(pipeline);
  app.add_option("--micro-batch-size", a.micro_batch_size, "Sequences per micro-batch")
      ->check(cli::number_in(1, 65536))->group(pipeline);
  app.add_option("--max-pending-w", a.max_pending_w,
                 "2BP: at most N micro-batches per stage wait for their W; older ones run early (0: no limit)")
      ->check(cli::number_in(0, cli::kMaxCount))->group(pipeline);
  app.add_option("--memory-limit-gb", a.memory_limit_gb,
                 "2BP: keep each rank's tensor memory under this many GiB by running deferred W's early (0: none)")
      ->check(cli::number_in(0, 1e6, " (0: none)"))->group(pipeline);
  app.add_flag("--recompute", a.recompute,
               "Activation recomputation: each stage keeps only its inputs after F and re-runs the forward before "
               "its I (or B)")->group(pipeline);
  app.add_option("--timeout", a.timeout_s, "Seconds any wait may block before failing")
      ->check(cli::number_in(1e-3, 1e7, " seconds"))->group(pipeline);

  const std::string training = "Training";
  app.add_option("--steps", a.steps, "Training steps (also the learning-rate schedule's horizon)")
      ->check(steps)->group(training);
  app.add_option("--stop-after", a.stop_after, "Stop after this step, to be resumed later (0: run to --steps)")
      ->check(steps_or_none)->group(training);
  app.add_option("--warmup-steps", a.warmup_steps, "Linear warm-up steps (-1: steps / 10)")
      ->check(cli::number_in(-1, 1e9, " (-1: steps / 10)"))->group(training);
  app.add_option("--lr", a.lr, "Peak learning rate (AdamW, cosine decay to 10%)")
      ->check(cli::number_in(1e-12, 1e3))->group(training);
  app.add_option("--weight-decay", a.weight_decay, "AdamW weight decay")->check(cli::number_in(0, 1e3))
      ->group(training);
  app.add_option("--clip", a.clip, "Clip the global gradient norm to this value (0: no clipping)")
      ->check(cli::number_in(0, 1e30, " (0: no clipping)"))->group(training);
  app.add_option("--on-nonfinite", a.on_nonfinite,
                 "A NaN or Inf loss or gradient: stop (error naming the step and stages) or skip that update")
      ->check(CLI::IsMember({"stop", "skip"}))->group(training);
  app.add_option("--zero", a.zero, "1: shard the AdamW state over the --dp replicas (ZeRO-1); 0: do not")
      ->check(CLI::IsMember({0, 1}))->group(training);
  app.add_option("--device", a.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->group(training);
  app.add_option("--dtype", a.dtype,
                 "fp32; bf16: mixed precision (bfloat16 compute, float32 master weights, gradients and AdamW state); "
                 "bf16-pure: everything in bfloat16")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-pure"}))->group(training);

  const std::string data = "Data and evaluation";
  app.add_option("--data", a.data, "Token file (see twobp/data.h); default: the built-in corpus, byte-level")
      ->check(CLI::ExistingFile)->group(data);
  app.add_option("--seq-len", a.seq_len, "Tokens per sequence (0: the model's)")
      ->check(cli::number_in(0, 1 << 20, " (0: the model's)"))->group(data);
  app.add_flag("--pack", a.pack,
               "Packed documents: attention stays within a document, positions restart per document (positions "
               "and document ids cross every stage boundary)")->group(data);
  app.add_option("--doc-separator", a.doc_separator, "With --pack: the token that ends a document")
      ->check(cli::number_in(0, 65535))->group(data);
  app.add_option("--seq-len-warmup", a.seq_len_warmup,
                 "Grow the sequence length linearly to --seq-len over this many steps (0: none)")
      ->check(steps_or_none)->group(data);
  app.add_option("--eval-every", a.eval_every,
                 "Evaluate the held-out split every N steps and after the last (0: never; holds out --eval-fraction)")
      ->check(steps_or_none)->group(data);
  app.add_option("--eval-batches", a.eval_batches, "Global batches per evaluation (the same ones every time)")
      ->check(cli::number_in(1, 4096))->group(data);
  app.add_option("--eval-fraction", a.eval_fraction, "The corpus's tail held out for evaluation")
      ->check(cli::number_in(1e-6, 1 - 1e-6))->group(data);

  const std::string output = "Output and checkpoints";
  app.add_option("--json", a.json, "Write the per-step losses (or the dry-run plan) as JSON")
      ->check(cli::writable_file())->group(output);
  app.add_option("--trace", a.trace, "Chrome trace of the last step, every rank (one track per world rank)")
      ->check(cli::writable_file())->group(output);
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "Write a checkpoint here at the end (and every N steps)")
      ->check(cli::writable_directory())->group(output);
  app.add_option("--checkpoint-every", a.checkpoint_every, "Checkpoint every N steps (0: at the end only)")
      ->check(steps_or_none)->group(output);
  app.add_flag("--resume", a.resume, "Resume from --checkpoint-dir")->group(output);
  app.add_flag("--dry-run", a.dry_run, "Print sizes and memory estimates without allocating the model")
      ->group(output);
  app.add_option("--gpu-memory-gb", a.gpu_memory_gb,
                 "With --dry-run: say whether each rank's estimated peak fits this many GiB (0: do not judge)")
      ->check(cli::number_in(0, 1e6, " (0: none)"))->group(output);
  app.add_option("--powercap-root", a.powercap_root,
                 "Where RAPL's powercap zones are (energy per step on CPUs; another root for tests or containers)")
      ->group(output);

  app.footer(R"(Examples:
  llama_pipeline                                            # tiny model, 2 ranks as threads, 1F1B with 2BP
  llama_pipeline --no-2bp --schedule zb-h1 --steps 50       # the fused backward, for comparison
  llama_pipeline --model 7b --ranks 4 --dry-run --gpu-memory-gb 80   # does 7B fit on 4 GPUs?
  mpirun -n 4 llama_pipeline --model small --device cuda     # one rank per process (torchrun, srun alike)
  llama_pipeline --dp 2 --zero 1 --eval-every 10 --json run.json
Documentation: README.md and docs/ in the source tree.)");
}

/// Options that have no effect in this run, for a warning (a launcher's world size replaces --ranks; some options
/// only mean something beside another).
std::vector<std::string> ignored_options(const CLI::App& app, const Args& a) {
  std::vector<std::string> ignored;
  auto given = [&](const char* name) { return app.count(name) > 0; };
  if (given("--gpu-memory-gb") && !a.dry_run) ignored.emplace_back("--gpu-memory-gb (only with --dry-run)");
  if (given("--doc-separator") && !a.pack) ignored.emplace_back("--doc-separator (only with --pack)");
  if ((given("--eval-batches") || given("--eval-fraction")) && a.eval_every == 0) {
    ignored.emplace_back("--eval-batches/--eval-fraction (only with --eval-every)");
  }
  if (given("--checkpoint-every") && a.checkpoint_dir.empty()) {
    ignored.emplace_back("--checkpoint-every (only with --checkpoint-dir)");
  }
  if (given("--schedule") && !a.schedule_file.empty()) ignored.emplace_back("--schedule (--schedule-file decides)");
  if (given("--zero") && a.zero == 1 && a.dp == 1) ignored.emplace_back("--zero 1 (nothing to shard with --dp 1)");
  return ignored;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Pipeline-parallel training of a LLaMa-like model with 2-stage backpropagation"};
  add_options(app, a);
  if (const std::optional<int> status = twobp::cli::parse(app, argc, argv)) return *status;
  a.ignored = ignored_options(app, a);
  a.ranks_given = app.count("--ranks") > 0;
  try {
    return run(a, argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "llama_pipeline: error: {}\n", twobp::cli::error_message(e));
    return dynamic_cast<const twobp::Error*>(&e) != nullptr ? 2 : 1;
  }
}
