// llama_pipeline's command line: every option in a group, with its default, and checked when parsed
// (examples/common/twobp_cli.h); the rules between options.
#include "example.h"
#include "twobp/checkpoint.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp_cli.h"  // examples/common: option checks shared with twobp_bench

namespace llama_example {

namespace cli = twobp::cli;
namespace {

/// A count of steps where 0 means none.
auto steps_or_none() { return cli::number_in(0, 1e9, " (0: none)"); }

void add_model_options(CLI::App& app, Args& a) {
  // Upper bounds far above any real run's (a 405B model has 126 blocks of width 16384), low enough that sizes
  // multiplied together stay in range; whether the model then fits is check_fits_in_host_memory()'s question.
  const auto width = cli::number_in(0, 1 << 20, " (0: the model's)");
  const auto few = cli::number_in(0, 4096, " (0: the model's)");

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
  app.add_option("--init-from", a.init_from,
                 "A Hugging Face Llama directory (config.json, model.safetensors or a sharded index): a fresh run "
                 "of its model from its weights (step 0, new optimizer state); --seq-len defaults to its "
                 "max_position_embeddings, at most 2048")
      ->check(CLI::ExistingDirectory)->group(model);

}

/// --schedule and how --schedule auto measures and chooses.
void add_schedule_options(CLI::App& app, Args& a) {
  const std::string pipeline = "Pipeline";
  std::vector<std::string> schedules = twobp::schedule_names();
  schedules.push_back("auto");
  app.add_option("--schedule", a.schedule,
                 "Pipeline schedule; auto: start with --auto-start, measure, switch to the schedule of the same "
                 "placement the simulator predicts fastest, and back if it measures slower")
      ->check(CLI::IsMember(schedules))->group(pipeline);
  app.add_option("--auto-start", a.auto_start,
                 "With --schedule auto: the schedule measured first; its placement (1f1b: one chunk per rank, "
                 "interleaved-1f1b, zb-v: two) bounds the candidates")
      ->check(CLI::IsMember(twobp::schedule_names()))->group(pipeline);
  app.add_option("--auto-steps", a.auto_steps,
                 "With --schedule auto: steps measured before choosing, and for each candidate measured (the first "
                 "of each is warm-up)")
      ->check(cli::number_in(2, 1000))->group(pipeline);
  app.add_option("--auto-candidates", a.auto_candidates,
                 "With --schedule auto: how many of the fastest predicted candidates (within --auto-within of the "
                 "best) are measured (and as many of other placements with --auto-placements); the job keeps the "
                 "fastest measured of them and the starting schedule")
      ->check(cli::number_in(1, 100))->group(pipeline);
  app.add_option("--auto-memory-limit-gb", a.auto_memory_limit_gb,
                 "With --schedule auto: only candidates whose peak tensor memory per rank, predicted from the memory "
                 "measured while probing, stays within this many GiB (0: any)")
      ->check(cli::number_in(0, 1e6, " (0: any)"))->group(pipeline);
  app.add_flag("--auto-recompute", a.auto_recompute,
               "With --schedule auto: the candidates include every form with the stages of the first 1, 2, ..., "
               "all pipeline ranks recomputing (slower, less memory: useful with --auto-memory-limit-gb); the "
               "starting schedule is measured with every stage recomputing too")
      ->group(pipeline);
  app.add_flag("--auto-weight-sizes", a.auto_weight_sizes,
               "With --schedule auto: also measure the starting 2BP form with its batched W's one micro-batch at a "
               "time, so that a W's fixed cost is known and candidates that batch W's differently are predicted "
               "right (useful on GPUs, where a batched W is cheaper per micro-batch)")
      ->group(pipeline);
  app.add_flag("--auto-placements", a.auto_placements,
               "With --schedule auto: after choosing among the starting placement's forms, also measure up to "
               "--auto-candidates forms of other placements (chunks per rank, order of stages on ranks) that the "
               "planner, fitted to the measured costs, predicts fastest; the weights and optimizer state move "
               "through a checkpoint in --checkpoint-dir/placement, and the job keeps the fastest measured")
      ->group(pipeline);
  app.add_option("--auto-within", a.auto_within,
                 "With --schedule auto: a candidate is measured when its prediction is within this share of the "
                 "best prediction (and of the running form's)")
      ->check(cli::number_in(0, 100))->group(pipeline);
}

void add_pipeline_options(CLI::App& app, Args& a) {
  const std::string pipeline = "Pipeline";
  app.add_option("--schedule-file", a.schedule_file,
                 "A schedule file: twobp's text form, or PyTorch's compute_only CSV (*.csv); overrides --schedule, "
                 "keeps its own 2BP mode")
      ->check(cli::regular_file())->group(pipeline);
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
  app.add_option("--recompute-ranks", a.recompute_ranks,
                 "With --recompute: only the stages of pipeline ranks 0 .. N-1 recompute (the first ranks hold the "
                 "most activations in 1F1B-like schedules; 0: every rank)")
      ->check(cli::number_in(0, cli::kMaxCount, " (0: every rank)"))->group(pipeline);
  app.add_option("--recompute-on", a.recompute_on,
                 "With --recompute: only the stages of these pipeline ranks recompute (ranks and ranges, e.g. 3 or "
                 "0-1,3: what `twobp_bench plan` ranks where the memory is not on the first ranks)")
      ->excludes("--recompute-ranks")->group(pipeline);
  app.add_option("--timeout", a.timeout_s, "Seconds any wait may block before failing")
      ->check(cli::number_in(1e-3, 1e7, " seconds"))->group(pipeline);

}

/// Training, data and evaluation.
void add_training_options(CLI::App& app, Args& a) {
  const std::string training = "Training";
  app.add_option("--steps", a.steps,
                 "Training steps (also the learning-rate schedule's horizon); 0: none, to export a model loaded with "
                 "--init-from or --resume (--export-hf)")
      ->check(cli::number_in(0, 1e9, " (0: export only)"))->group(training);
  app.add_option("--stop-after", a.stop_after, "Stop after this step, to be resumed later (0: run to --steps)")
      ->check(steps_or_none())->group(training);
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
  app.add_option("--zero", a.zero,
                 "1: shard the AdamW state over the --dp replicas (ZeRO-1); 2: the gradients too, reduce-scattered as "
                 "W finishes each bucket (ZeRO-2); 0: do not")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            return text == "0" || text == "1" || text == "2"
                       ? std::string()
                       : "must be 0 (no sharding), 1 (ZeRO-1) or 2 (ZeRO-2), got '" + text + "'";
          },
          "{0,1,2}"))
      ->group(training);
  app.add_option("--device", a.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->group(training);
  app.add_flag("--nccl-stream-waits", a.nccl_stream_waits,
               "over NCCL (--device cuda, one rank per process): wait for receives on the compute stream, with a "
               "watchdog thread for their timeouts, instead of on the host (not run on a GPU yet; docs/GPU.md)")
      ->group(training);
  app.add_option("--dtype", a.dtype,
                 "fp32; bf16: mixed precision (bfloat16 compute, float32 master weights, gradients and AdamW state); "
                 "bf16-pure: everything in bfloat16")
      ->check(twobp::cli::one_spelling(twobp::parse_precision, "fp32, bf16 or bf16-pure"))->group(training);

  const std::string data = "Data and evaluation";
  app.add_option("--data", a.data,
                 "Token file, 16- or 32-bit tokens (see twobp/data.h; scripts/tokens.py writes them); default: the "
                 "built-in corpus, byte-level")
      ->check(cli::regular_file())->group(data);
  app.add_option("--seq-len", a.seq_len, "Tokens per sequence (0: the model's)")
      ->check(cli::number_in(0, 1 << 20, " (0: the model's)"))->group(data);
  app.add_flag("--pack", a.pack,
               "Packed documents: attention stays within a document, positions restart per document (positions "
               "and document ids cross every stage boundary), and no target predicts across documents. The loss, "
               "packed or not, is the token mean over the global batch (every unmasked target token weighs the "
               "same, however the batch is cut into micro-batches and replicas)")->group(data);
  app.add_option("--doc-separator", a.doc_separator, "With --pack: the token that ends a document")
      ->check(cli::number_in(0, (1 << 20) - 1))->group(data);
  app.add_option("--seq-len-warmup", a.seq_len_warmup,
                 "Grow the sequence length linearly to --seq-len over this many steps (0: none)")
      ->check(steps_or_none())->group(data);
  app.add_option("--eval-every", a.eval_every,
                 "Evaluate the held-out split every N steps and after the last (0: never; holds out --eval-fraction)")
      ->check(steps_or_none())->group(data);
  app.add_option("--eval-batches", a.eval_batches, "Global batches per evaluation (the same ones every time)")
      ->check(cli::number_in(1, 4096))->group(data);
  app.add_option("--eval-fraction", a.eval_fraction, "The corpus's tail held out for evaluation")
      ->check(cli::number_in(1e-6, 1 - 1e-6))->group(data);

}

void add_output_options(CLI::App& app, Args& a) {
  const std::string output = "Output and checkpoints";
  app.add_option("--json", a.json, "Write the per-step losses (or the dry-run plan) as JSON")
      ->check(cli::writable_file())->group(output);
  app.add_option("--costs-json", a.costs_json,
                 "Write the run's measured per-stage costs (F, I, W, B; every full-length step after the first, agreed "
                 "over the ranks) and message time here, in the form `twobp_bench plan --costs-json` plans any "
                 "placement from (a 2BP run, or --schedule auto, measures I and W)")
      ->check(cli::writable_file())->group(output);
  app.add_option("--trace", a.trace, "Chrome trace of the last step, every rank (one track per world rank)")
      ->check(cli::writable_file())->group(output);
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "Write a checkpoint here at the end (and every N steps)")
      ->check(cli::writable_directory())->group(output);
  app.add_option("--checkpoint-every", a.checkpoint_every, "Checkpoint every N steps (0: at the end only)")
      ->check(steps_or_none())->group(output);
  app.add_flag("--resume", a.resume, "Resume from --checkpoint-dir")->group(output);
  app.add_option("--export-hf", a.export_hf,
                 "At the end, write the model as a Hugging Face Llama here (config.json, model.safetensors) for "
                 "transformers' LlamaForCausalLM.from_pretrained")
      ->check(cli::writable_directory())->group(output);
  app.add_option("--export-dtype", a.export_dtype,
                 "With --export-hf: the weights' dtype (default: the run's weights, float32 masters under --dtype "
                 "bf16)")
      ->check(CLI::IsMember({"bf16", "f32"}))->group(output);
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
  llama_pipeline --schedule auto --steps 30                 # measure, then run the fastest schedule
  llama_pipeline --schedule auto --steps 60 --auto-placements --checkpoint-dir ck   # other placements too
  llama_pipeline --init-from Llama-3.2-1B --data t.tok --lr 2e-5 --export-hf tuned   # fine-tune a Hugging Face Llama
  llama_pipeline --resume --checkpoint-dir ck --steps 0 --export-hf out   # a checkpoint as a Hugging Face model
Documentation: README.md and docs/ in the source tree.)");
}

}  // namespace

void add_options(CLI::App& app, Args& a) {
  // A repeated option takes its last value, so scripts can append overrides to a common command line.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->always_capture_default();
  cli::add_version_flag(app, "llama_pipeline");
  add_model_options(app, a);
  add_schedule_options(app, a);
  add_pipeline_options(app, a);
  add_training_options(app, a);
  add_output_options(app, a);
}

/// Options that have no effect in this run, for a warning (a launcher's world size replaces --ranks; some options
/// only mean something beside another).
std::vector<std::string> ignored_options(const CLI::App& app, const Args& a) {
  std::vector<std::string> ignored;
  auto given = [&](const char* name) { return app.count(name) > 0; };
  if (given("--gpu-memory-gb") && !a.dry_run) ignored.emplace_back("--gpu-memory-gb (only with --dry-run)");
  if (given("--costs-json") && a.dry_run) ignored.emplace_back("--costs-json (nothing runs with --dry-run)");
  if (given("--doc-separator") && !a.pack) ignored.emplace_back("--doc-separator (only with --pack)");
  if ((given("--eval-batches") || given("--eval-fraction")) && a.eval_every == 0) {
    ignored.emplace_back("--eval-batches/--eval-fraction (only with --eval-every)");
  }
  if (given("--checkpoint-every") && a.checkpoint_dir.empty()) {
    ignored.emplace_back("--checkpoint-every (only with --checkpoint-dir)");
  }
  if (given("--schedule") && !a.schedule_file.empty()) ignored.emplace_back("--schedule (--schedule-file decides)");
  if ((given("--auto-start") || given("--auto-steps") || given("--auto-candidates") ||
       given("--auto-memory-limit-gb") || given("--auto-recompute") || given("--auto-weight-sizes") ||
       given("--auto-placements") || given("--auto-within")) &&
      (a.schedule != "auto" || !a.schedule_file.empty())) {
    ignored.emplace_back("--auto-start/--auto-steps/--auto-candidates/--auto-memory-limit-gb/--auto-recompute/"
                         "--auto-weight-sizes/--auto-placements/--auto-within (only with --schedule auto)");
  }
  if (given("--zero") && a.zero >= 1 && a.dp == 1) {
    ignored.emplace_back("--zero " + std::to_string(a.zero) + " (nothing to shard with --dp 1)");
  }
  if (given("--recompute-ranks") && !a.recompute) ignored.emplace_back("--recompute-ranks (only with --recompute)");
  if (given("--recompute-on") && !a.recompute) ignored.emplace_back("--recompute-on (only with --recompute)");
  if (given("--export-dtype") && a.export_hf.empty()) ignored.emplace_back("--export-dtype (only with --export-hf)");
  if (given("--checkpoint-dir") && a.steps == 0 && !a.resume) {
    ignored.emplace_back("--checkpoint-dir (--steps 0 runs no step to checkpoint)");
  }
  if (given("--nccl-stream-waits") && a.device != "cuda") {
    ignored.emplace_back("--nccl-stream-waits (only over NCCL: --device cuda, one rank per process)");
  }
  return ignored;
}

namespace {

// --resume of a checkpoint at or past the step this run ends at would train nothing and exit 0 as if it had.
void check_resume(const Args& a) {
  if (!a.resume || !twobp::checkpoint::checkpoint_exists(a.checkpoint_dir)) return;  // the loader says what is wrong
  if (a.steps == 0) return;  // --steps 0: no step, the checkpoint's weights exported as they are
  int64_t step = 0;
  try {
    step = twobp::checkpoint::read_manifest(a.checkpoint_dir).step;
  } catch (const twobp::IOError& e) {  // an edited or broken manifest: said before any rank starts
    throw twobp::IOError(fmt::format("--resume: {}", e.what()));
  }
  const int end = a.stop_after > 0 ? std::min(a.stop_after, a.steps) : a.steps;
  const std::string stop = a.stop_after > 0 ? fmt::format(", --stop-after {}", a.stop_after) : "";
  EXAMPLE_CHECK(step < end, twobp::UsageError,
              "--resume: the checkpoint in {} is of step {}, and this run ends at step {} (--steps {}{}): nothing is "
              "left to train; give --steps (and --stop-after) beyond {}",
              a.checkpoint_dir, step, end, a.steps, stop, step);
}

/// --init-from, --export-hf and --steps 0 (export only) with the other options.
void check_hf_options(const Args& a) {
  EXAMPLE_CHECK(a.init_from.empty() || !a.resume, twobp::UsageError,
                "--init-from with --resume: --init-from starts a fresh run from a Hugging Face model, --resume "
                "continues a checkpoint (which carries the model its run started from); give --init-from for a new "
                "run, --resume to continue one");
  EXAMPLE_CHECK(a.steps > 0 || (!a.export_hf.empty() && (a.resume || !a.init_from.empty())), twobp::UsageError,
                "--steps 0 trains nothing: it exports a loaded model; give --export-hf DIR with --init-from or "
                "--resume, or --steps 1 or more");
  EXAMPLE_CHECK(a.steps > 0 || (a.trace.empty() && a.costs_json.empty() && a.eval_every == 0), twobp::UsageError,
                "--steps 0 runs no step: --trace, --costs-json and --eval-every have nothing to record; leave them "
                "out");
}

}  // namespace

void validate_args(const Args& a) {
  EXAMPLE_CHECK(!a.resume || !a.checkpoint_dir.empty(), twobp::UsageError, "--resume needs --checkpoint-dir");
  twobp::cli::refuse_shared_paths({{"--json", a.json},
                                   {"--costs-json", a.costs_json},
                                   {"--trace", a.trace},
                                   {"--dump-schedule", a.dump_schedule},
                                   {"--checkpoint-dir", a.checkpoint_dir},
                                   {"--export-hf", a.export_hf}},
                                  {{"--schedule-file", a.schedule_file}, {"--data", a.data},
                                   {"--init-from", a.init_from}});
  check_hf_options(a);
  check_resume(a);
  EXAMPLE_CHECK(!a.auto_schedule() || (a.memory_limit_gb == 0 && a.max_pending_w == 0), twobp::UsageError,
              "--schedule auto cannot keep --memory-limit-gb or --max-pending-w (the simulator does not model the "
              "W's such a bound moves); bound the candidates' memory with --auto-memory-limit-gb, or choose the "
              "schedule yourself (twobp_bench plan predicts time and memory)");
  EXAMPLE_CHECK(!a.auto_schedule() || !(a.auto_recompute && a.recompute), twobp::UsageError,
              "--auto-recompute with --recompute: the stages recompute already; give one of them");
  EXAMPLE_CHECK(!a.auto_schedule() || a.steps >= a.auto_steps_needed(), twobp::UsageError,
              "--schedule auto measures --auto-steps {} steps of the starting schedule in each mode{} before choosing "
              "and as many for each of up to --auto-candidates {}{}; give --steps >= {}",
              a.auto_steps, a.auto_recompute ? ", with and without recomputation," : "", a.auto_candidates,
              a.auto_placements ? " of its placement and as many of other placements" : "", a.auto_steps_needed());
  // ZeRO-2's flat gradient shards follow the schedule's bucket order: the Pipeline refuses switch_schedule.
  EXAMPLE_CHECK(a.zero != 2 || a.dp == 1 || !a.auto_schedule(), twobp::UsageError,
                "--zero 2 with --schedule auto: ZeRO-2's gradient shards are laid out for one schedule, which the "
                "tuner would switch; pick a schedule, or use --zero 1");
  EXAMPLE_CHECK(!a.auto_schedule() || !a.auto_placements || !a.checkpoint_dir.empty(), twobp::UsageError,
              "--auto-placements moves the weights and optimizer state between placements through a checkpoint in "
              "--checkpoint-dir/placement, a directory every rank can read: give --checkpoint-dir");
}

}  // namespace llama_example
