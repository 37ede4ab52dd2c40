#pragma once
// What the files of llama_pipeline share (see main.cpp for the program):
//   options.cpp  the command line: options in groups, each checked when parsed; rules between options
//   plan.cpp     what every rank agrees on before the first step (model, schedule, partition), the dry run and
//                the memory estimate
//   train.cpp    one rank's training: its chunks, the pipeline, AdamW, the step loop, evaluation, checkpoints
//   hf.cpp       Hugging Face Llama checkpoints: the model of --init-from, its weights, and --export-hf
//   main.cpp     launch (threads, MPI or a launcher's store), data, the run's outputs
// It sticks to twobp's public API.

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "twobp/checkpoint.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/step_log.h"
#include "twobp/models/llama.h"
#include "twobp/precision.h"
#include "twobp/runtime/interrupt.h"
#include "twobp/plan/choose.h"
#include "twobp/plan/placement.h"
#include "twobp/schedule/schedule.h"
#include "twobp/trace/attribution.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

// The example's one-line check (the library's TWOBP_CHECK is private to src/: a program keeps its own name).
#define EXAMPLE_CHECK(cond, type, ...)                 \
  do {                                                 \
    if (!(cond)) throw type(fmt::format(__VA_ARGS__)); \
  } while (false)

namespace llama_example {

namespace llm = twobp::models;
namespace ck = twobp::checkpoint;

// ---- The command line (options.cpp) ----

struct Args {
  std::string model = "tiny";
  llm::LlamaDims dims;  // sizes replacing the preset's (--dim ... --vocab)
  std::string schedule = "1f1b";  // or "auto" (twobp::AutoSchedule): start with auto_start, then choose
  std::string auto_start = "1f1b";
  int auto_steps = 4;  // --schedule auto: steps measured before choosing, and before keeping the choice
  int auto_candidates = 3;  // --schedule auto: the fastest predicted candidates measured before choosing
  double auto_memory_limit_gb = 0;  // --schedule auto: candidates' predicted peak tensor memory per rank, GiB (0: any)
  bool auto_recompute = false;  // --schedule auto: also the forms with the stages of the first 1..p ranks recomputing
  bool auto_weight_sizes = false;  // --schedule auto: also the 2BP form with its W's one micro-batch at a time
  /// --schedule auto: after choosing among the starting placement's forms, also measure up to --auto-candidates
  /// forms of other placements (the planner's fastest predicted from the probes' costs), moving the weights and
  /// optimizer state through a checkpoint in --checkpoint-dir/placement, and keep the fastest measured.
  bool auto_placements = false;
  double auto_within = 0.10;  // --schedule auto: candidates measured when predicted within this of the best
  /// --schedule auto: the starting schedule's forms it measures before choosing, at most (each mode, with and
  /// without recomputation with --auto-recompute, the 2BP form's W's one by one with --auto-weight-sizes).
  int auto_probes() const { return (auto_recompute ? 4 : 2) + (auto_weight_sizes ? 1 : 0); }
  /// --schedule auto: the steps it may measure before the job runs its choice to the end.
  int auto_steps_needed() const { return (auto_probes() + auto_candidates * (auto_placements ? 2 : 1)) * auto_steps; }
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
  bool nccl_stream_waits = false;  // NcclOptions::stream_waits (processes on GPUs only)
  std::string dtype = "fp32";
  std::string data;
  std::string checkpoint_dir;
  int checkpoint_every = 0;
  bool resume = false;
  std::string init_from;    // a Hugging Face Llama directory: the model and its weights for a fresh run (hf.cpp)
  std::string export_hf;    // write the trained weights here as a Hugging Face Llama at the end (hf.cpp)
  std::string export_dtype;  // --export-hf's dtype: "bf16" or "f32" ("": the weights' own, float32 masters)
  std::string trace;
  double timeout_s = 300;
  int stages = 2;
  int dp = 1;  // data-parallel replicas
  int max_pending_w = 0;  // memory-bounded 2BP: 0 = no limit
  double memory_limit_gb = 0;  // memory-bounded 2BP in GiB of tensor memory per rank: 0 = no limit
  int64_t memory_limit_bytes() const { return static_cast<int64_t>(memory_limit_gb * 1024.0 * 1024.0 * 1024.0); }
  double gpu_memory_gb = 0;    // dry run: say whether each rank fits this much (0: do not judge)
  bool pack = false;      // packed documents: positions and document mask cross every stage boundary
  int doc_separator = 10;  // the token that ends a document ('\n' for the byte-level corpus)
  int seq_len_warmup = 0;  // steps over which the sequence length grows to --seq-len (0: none)
  bool recompute = false;  // activation recomputation on every chunk
  int recompute_ranks = 0;  // with recompute: only the chunks of pipeline ranks 0 .. recompute_ranks - 1 (0: all)
  std::string recompute_on;  // with recompute: only the chunks of these pipeline ranks ("0-1,3"; "": see above)
  int chunks_per_rank = 0;  // 0: the schedule's default
  std::string schedule_file;
  std::string dump_schedule;  // write the run's schedule here (.csv: PyTorch's compute_only form) and go on
  std::string partition;
  bool dry_run = false;
  std::string json;
  std::string costs_json;  // the run's measured per-stage costs, in the form `twobp_bench plan --costs-json` reads
  std::string powercap_root = twobp::energy::EnergyOptions{}.powercap_root;  // RAPL zones (energy on CPUs)
  uint64_t seed = 1234;
  int zero = 0;                // 1: AdamW state sharded over the data-parallel replicas (ZeRO-1); 2: gradients too
  std::string on_nonfinite = "stop";  // a NaN/Inf loss or gradient: stop (error) or skip the update
  int eval_every = 0;          // evaluate on the held-out split every N steps (0: never)
  int eval_batches = 2;        // global batches per evaluation
  double eval_fraction = 0.1;  // the corpus's tail held out for evaluation when --eval-every > 0
  // Set by main() from the command line as given:
  std::vector<std::string> ignored;  // options that have no effect in this run (warned about)
  bool ranks_given = false;          // --ranks (--stages) on the command line (ignored under a launcher)
  bool model_given = false;          // --model on the command line (refused with a Hugging Face model)

  bool auto_schedule() const { return schedule == "auto" && schedule_file.empty(); }
};

/// Adds every option, in groups, each checked when parsed.
void add_options(CLI::App& app, Args& a);
/// Options given that have no effect in this run, for a warning.
std::vector<std::string> ignored_options(const CLI::App& app, const Args& a);
/// The rules between options (each option's own range is checked when parsed).
void validate_args(const Args& a);

// ---- The plan (plan.cpp) ----

/// Everything every rank agrees on before the first step.
struct Plan {
  Args args;
  llm::LlamaConfig config;
  int world_size = 1;  // pipeline ranks of one replica (pp); the job has dp * world_size ranks
  int dp = 1;
  int64_t seq_len = 0;
  twobp::Schedule schedule;
  llm::Partition partition;
  // --dtype: twobp::compute_dtype() of it is what the chunks compute in (and activations travel in).
  twobp::Precision precision = twobp::Precision::kFloat32;
  // What a checkpoint must match to be resumed (the model and its training), and the layout it was written with
  // (recorded, not checked: checkpoints load by global tensor name into any pp, dp, schedule and partition).
  ck::CheckpointConfig checkpoint_config;
  ck::CheckpointConfig checkpoint_layout;
  // The pipeline ranks whose chunks recompute their activations (--recompute, --recompute-ranks, --recompute-on).
  std::vector<int> recompute_ranks;
  // A Hugging Face model (--init-from, or --resume of a run that started from one): the text of its config.json,
  // which the run's checkpoints carry (so that --resume needs no --init-from) and --export-hf keeps the other keys
  // of. Empty: a twobp preset (--model, --dim ...).
  std::string hf_config;
};

/// `world_size`: the pipeline ranks of one replica. Model, schedule and partition errors surface here.
Plan make_plan(const Args& args, int world_size);
/// The placement and form `p` runs (--auto-placements moves between them: twobp/plan/placement.h), and `p` running
/// `to` instead (its checkpoint layout too).
twobp::Placement placement_of(const Plan& p);
Plan with_placement(const Plan& p, const twobp::Placement& to);
/// The run's settings, as the JSON output starts.
nlohmann::json config_json(const Plan& p);
/// A CPU run that clearly cannot fit in the machine's memory: UsageError before anything is allocated.
void check_fits_in_host_memory(const Plan& p, bool ranks_are_threads, int my_pipeline_rank);
/// --dry-run: sizes and memory per rank from formulas, nothing allocated.
int dry_run(const Plan& p);

// ---- Training (train.cpp) ----

/// One step as reported (twobp/metrics/step_log.h: its progress line, the summary and the JSON).
using StepRecord = twobp::metrics::StepRecord;

/// What rank 0 reports and the threads share.
struct Shared {
  std::mutex mutex;
  std::vector<StepRecord> records;
  bool memory_limit_noted = false;  // rank 0 said once why the memory limit was exceeded
  std::vector<twobp::Trace> traces;  // the last step's, by world rank (gather_traces: threads or processes)
  int64_t resumed_from = 0;
  std::string energy_source, energy_note;  // rank 0's meter ("nvml", "rapl" or ""), and why it has none
  std::vector<double> optimizer_state_bytes;  // by world rank, after the last step
  // Where replica 0's ranks' step time went, by pipeline rank: the mean over the run's steps (its first step, with
  // the start-up barrier, left out when there are others).
  std::vector<twobp::StepAttribution> attribution;
  // --schedule auto: what it decided, (step, line) in order, and the schedule the run ended with.
  std::vector<std::pair<int, std::string>> auto_decisions;
  twobp::Placement final_placement;  // the run ended with (--auto-placements may move it), recomputing ranks too
  std::vector<twobp::ScheduleCandidate> auto_ranking;  // the candidates, fastest predicted first
  // SIGINT/SIGTERM: agreed by every rank after each step, which then ends the run as its last (train_rank).
  twobp::InterruptGuard* interrupts = nullptr;
  // Called by world rank 0 before each step (steps done, steps of the run), outside `mutex`: writes --json so far
  // (a launcher that kills the ranks after its signal loses at most the last second of steps) and updates the
  // interrupt's announcement.
  std::function<void(int done, int end)> progress;
  std::vector<std::string> exported;  // --export-hf: the files world rank 0 wrote
};

/// Trains this rank of `world` (every replica's ranks) from the checkpoint or step 0 to --stop-after / --steps.
void train_rank(const Plan& p, twobp::Transport& world, c10::Device device, const twobp::data::Tokens& tokens,
                const twobp::data::Tokens& held_out, Shared& shared);
// ---- Hugging Face Llama checkpoints (hf.cpp) ----

/// --seq-len's default with a Hugging Face model: its max_position_embeddings, at most this (Llama 3.1 declares
/// 131072, far beyond what a fine-tuning run wants by default).
inline constexpr int64_t kHfDefaultSeqLen = 2048;

/// The model of a Hugging Face config.json (`text`, from `source`), checked against the sizes the command line
/// gives: --model is refused (the model is the directory's), and --dim ... --vocab must equal config.json's
/// (UsageError naming both otherwise).
llm::LlamaConfig hf_model_config(const Args& a, const std::string& text, const std::string& source);
/// The text of DIR/config.json (--init-from). IOError naming the file when it cannot be read.
std::string read_hf_config_text(const std::string& dir);
/// The text of the Hugging Face config.json a twobp checkpoint in `dir` carries (a run from --init-from wrote it);
/// empty for a checkpoint of a twobp preset or when there is no checkpoint.
std::string checkpoint_hf_config(const std::string& dir);
/// The CheckpointConfig key holding that text.
inline constexpr const char* kHfConfigKey = "hf_config";

/// --init-from: this rank's tensors (`named`: the float32 masters under mixed precision) from the directory,
/// converted to their dtype; only this rank's tensors are read.
void load_hf_weights(const Plan& p, const ck::NamedTensors& named, bool reports);
/// --export-hf, collective over the job: replica 0's pipeline ranks send every tensor of the model to world rank
/// 0, which writes the directory (export_hf_llama) and lists its files in shared.exported; the other replicas hold
/// copies and take no part.
void export_hf_model(const Plan& p, const ck::NamedTensors& named, twobp::Transport& pipeline, int replica,
               twobp::Duration timeout, Shared& shared);

/// The run's closing lines on rank 0: what was trained, how fast, where each rank's step time went, and which
/// files it wrote.
void print_summary(const std::vector<StepRecord>& records, const std::vector<twobp::StepAttribution>& attribution,
                   double wall_s, const std::vector<std::string>& written);

}  // namespace llama_example
