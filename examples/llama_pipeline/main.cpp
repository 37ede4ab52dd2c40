// llama_pipeline: trains a LLaMa-like model with pipeline parallelism and (optionally) 2-stage backpropagation.
// README.md beside this file: usage, ranks and launchers, data parallelism, devices and precision, steps, the
// optimizer, evaluation, energy and packed sequences. This file launches the ranks and writes the outputs; the
// command line, the plan and the training of a rank have files of their own (example.h lists them).

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>

#include "example.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/files.h"
#include "twobp/metrics/memory.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/job.h"
#include "twobp/runtime/launch.h"
#include "twobp/schedule/text.h"
#include "twobp_cli.h"  // examples/common: option checks shared with twobp_bench

namespace llama_example {
namespace {

/// The training split of the corpus (--data, or the built-in one) and, with --eval-every, its held-out tail.
struct Corpus {
  twobp::data::Tokens tokens, held_out;
};
Corpus load_corpus(const Args& args, const Plan& plan) {
  EXAMPLE_CHECK(!args.data.empty() || plan.config.vocab_size >= twobp::data::ByteTokenizer::kVocabSize,
              twobp::UsageError, "--vocab {}: the built-in corpus is byte-level and needs a vocabulary of at least {} "
              "tokens; give --vocab {} or more, or --data with a token file", plan.config.vocab_size,
              twobp::data::ByteTokenizer::kVocabSize, twobp::data::ByteTokenizer::kVocabSize);
  EXAMPLE_CHECK(!args.pack || args.doc_separator < plan.config.vocab_size, twobp::UsageError,
              "--doc-separator {} is not a token of the model's vocabulary of {} (--vocab)", args.doc_separator,
              plan.config.vocab_size);
  // 16- or 32-bit token files alike (twobp/data.h); every token must be below the model's vocabulary.
  twobp::data::Tokens tokens =
      args.data.empty() ? twobp::data::ByteTokenizer::encode(twobp::data::builtin_corpus())
                        : twobp::data::read_token_file(args.data, static_cast<uint32_t>(plan.config.vocab_size));
  // --eval-every: the corpus's last --eval-fraction is held out (never trained on) for evaluation.
  try {
    twobp::data::HeldOutSplit split = twobp::data::split_held_out(
        std::move(tokens), args.eval_every > 0 ? args.eval_fraction : 0.0, plan.seq_len,
        args.data.empty() ? "the built-in corpus" : args.data);
    return {std::move(split.train), std::move(split.held_out)};
  } catch (const twobp::UsageError& e) {
    throw twobp::UsageError(fmt::format("{} (--seq-len{})", e.what(), args.eval_every > 0 ? ", --eval-fraction" : ""));
  }
}

/// What the run ended with under --schedule auto.
nlohmann::json final_json(const twobp::Placement& p) {
  return {{"schedule", p.schedule.name},
          {"2bp", p.schedule.backward == twobp::BackwardMode::kSplit},
          {"recompute_ranks", p.recompute_ranks},
          {"chunks_per_rank", p.schedule.num_stages / p.schedule.num_ranks},
          {"partition", p.partition.layout()}};
}

/// The --json document: the run's settings (config_json), what it measured and decided, and every step.
nlohmann::json run_json(const Plan& plan, const Shared& shared, std::size_t held_out_tokens) {
  const Args& args = plan.args;
  nlohmann::json j = config_json(plan);
  j["resumed_from"] = shared.resumed_from;
  j["zero"] = args.zero;
  // Measured: the bytes of AdamW state each rank held after the last step (its max, and every world rank's).
  j["optimizer_state_bytes"] = shared.optimizer_state_bytes.empty()
                                   ? nlohmann::json()
                                   : nlohmann::json(*std::max_element(shared.optimizer_state_bytes.begin(),
                                                                      shared.optimizer_state_bytes.end()));
  j["optimizer_state_bytes_per_rank"] = shared.optimizer_state_bytes;
  j["energy_source"] = nullptr;  // no meter on rank 0
  if (!shared.energy_source.empty()) j["energy_source"] = shared.energy_source;
  if (!shared.energy_note.empty()) j["energy_note"] = shared.energy_note;
  if (!shared.attribution.empty()) {
    j["attribution"] = nlohmann::json::parse(twobp::to_attribution_json(shared.attribution));
  }
  if (args.auto_schedule()) {  // what twobp::AutoSchedule decided, at which steps (0-based), and the outcome
    nlohmann::json decisions = nlohmann::json::array();
    for (const auto& [step, line] : shared.auto_decisions) decisions.push_back({{"step", step}, {"decision", line}});
    nlohmann::json ranking = nlohmann::json::array();
    for (const auto& c : shared.auto_ranking) {
      ranking.push_back({{"schedule", c.name}, {"2bp", c.mode == twobp::BackwardMode::kSplit},
                         {"recompute_ranks", c.recompute_ranks}, {"predicted_ms", c.predicted_ms},
                         {"predicted_peak_bytes", c.predicted_peak_bytes}});
    }
    j["auto_schedule"] = {{"start", plan.schedule.name},
                          {"decisions", decisions},
                          {"ranking", ranking},
                          // the schedule it ended with: known at the end (a --json written as the run goes has none)
                          {"final", shared.final_placement.schedule.num_ranks > 0
                                        ? final_json(shared.final_placement)
                                        : nlohmann::json()}};
  }
  if (args.eval_every > 0) {
    j["eval"] = {{"every", args.eval_every}, {"batches", args.eval_batches}, {"fraction", args.eval_fraction},
                 {"held_out_tokens", held_out_tokens}};
  }
  j["steps"] = nlohmann::json::parse(twobp::metrics::steps_json(shared.records));
  return j;
}

/// Shared::progress for world rank 0: before each step, the interrupt's announcement ("finishing step N of M, then
/// writing ...") and --json of the steps done ("complete": false), rewritten at most once a second (a device node
/// or FIFO gets only the final document, twobp::rewritable).
std::function<void(int, int)> progress_writer(const Plan& plan, Shared& shared, std::size_t held_out_tokens,
                                              twobp::InterruptGuard& interrupts) {
  const Args& args = plan.args;
  std::vector<std::string> outputs;
  for (const std::string* file : {&args.json, &args.trace, &args.costs_json, &args.checkpoint_dir, &args.export_hf}) {
    if (!file->empty()) outputs.push_back(*file);
  }
  const std::string then = outputs.empty() ? "then stopping" : fmt::format("then writing {}", fmt::join(outputs, ", "));
  const bool rewrite = !args.json.empty() && twobp::rewritable(args.json);
  auto last_write = std::make_shared<std::chrono::steady_clock::time_point>();
  return [&plan, &shared, held_out_tokens, &interrupts, then, rewrite, last_write](int done, int end) {
    interrupts.set_announcement(fmt::format("finishing step {} of {}, {}", done + 1, end, then));
    const auto now = std::chrono::steady_clock::now();
    if (!rewrite || now - *last_write < std::chrono::seconds(1)) return;
    nlohmann::json j;
    {
      std::lock_guard<std::mutex> lock(shared.mutex);
      j = run_json(plan, shared, held_out_tokens);
    }
    j["complete"] = false;
    twobp::cli::write_json(plan.args.json, j);
    *last_write = now;
  };
}

int run(Args args, int& argc, char**& argv) {
  validate_args(args);
  // Before any model exists: CPU tensor memory is counted per rank from here on (twobp/metrics/memory.h).
  twobp::memory::count_cpu_allocations();
  // Launch: MPI when an MPI launcher started us and MPI is built in; else the launcher's environment (torchrun,
  // srun, mpirun) with a TCPStore rendezvous; else ranks as threads (twobp/runtime/job.h).
  twobp::Job job(&argc, &argv, args.dp * args.stages, args.device == "cuda");
  job.set_nccl_stream_waits(args.nccl_stream_waits);
  const int world = job.world_size(), my_rank = job.rank();
  if (!job.processes()) twobp::cli::check_rank_threads(args.dp, args.stages);
  if (my_rank == 0) {
    for (const std::string& option : args.ignored) fmt::print(stderr, "llama_pipeline: warning: {} ignored\n", option);
    twobp::cli::warn_if_loaded("llama_pipeline", "a quieter machine for timings");
    if (job.processes() && args.ranks_given) {
      fmt::print(stderr, "llama_pipeline: warning: --ranks ignored: the launcher started {} ranks\n", world);
    }
  }
  const twobp::ParallelLayout layout = twobp::ParallelLayout::of(world, args.dp);  // dp must divide the world
  const Plan plan = make_plan(args, layout.pp);  // model, schedule and partition errors surface here
  if (my_rank == 0 && !plan.hf_config.empty() && args.data.empty() && args.steps > 0 && !args.dry_run) {
    fmt::print(stderr, "llama_pipeline: warning: training a Hugging Face model on the built-in corpus, whose byte "
               "tokens are not its tokenizer's; give --data with a token file from scripts/tokens.py --tokenizer\n");
  }
  if (!args.dump_schedule.empty() && my_rank == 0) {  // twobp's text form, or PyTorch's CSV (*.csv)
    twobp::save_schedule_file(args.dump_schedule, plan.schedule);
    fmt::print("schedule {} written to {}\n", plan.schedule.name, args.dump_schedule);
  }
  if (args.dry_run) return my_rank == 0 ? dry_run(plan) : 0;
  if (args.device == "cpu") check_fits_in_host_memory(plan, !job.processes(), layout.pipeline_rank(my_rank));

  // Everything that can be checked before a step is checked here, on every rank.
  const Corpus corpus = load_corpus(args, plan);
  if (args.resume) {
    const auto manifest = ck::read_manifest(args.checkpoint_dir);
    ck::check_config(args.checkpoint_dir, manifest, plan.checkpoint_config);  // any layout: loaded by name
  }
  EXAMPLE_CHECK(args.device != "cuda" || torch::cuda::is_available(), twobp::UsageError,
              "--device cuda, but no CUDA device is available");
  if (my_rank == 0) {
    fmt::print("llama_pipeline: model {} ({} parameters), {} ranks ({}) = {} replica(s) x {} pipeline ranks, {} "
               "stages, schedule {} with {}, partition {}, {} micro-batches of {} x {} tokens per replica{}{}, "
               "device {}, dtype {}\n",
               plan.config.name, llm::parameter_count(plan.config), world,
               job.how(),
               layout.dp, layout.pp, plan.schedule.num_stages,
               args.auto_schedule() ? "auto, starting with " + plan.schedule.name : plan.schedule.name,
               twobp::to_string(plan.schedule.backward),
               plan.partition.layout(), args.microbatches, args.micro_batch_size, plan.seq_len,
               args.pack ? " (packed documents)" : "",
               args.seq_len_warmup > 0 ? fmt::format(" (length warm-up over {} steps)", args.seq_len_warmup) : "",
               args.device, args.dtype);
  }

  Shared shared;
  // Processes: GPUs talk over NCCL (one rank per GPU: twobp::choose_cuda_device); CPUs over MPI, or without MPI
  // through the TCPStore that rank 0 serves (slow; meant for trying the launch, not for speed). Threads: Local.
  job.share_cores();
  // From here Ctrl-C and `kill` end the run after the step in progress, with its outputs (see the end of run()).
  twobp::InterruptGuard interrupts(/*announce=*/my_rank == 0);
  shared.interrupts = &interrupts;
  shared.progress = progress_writer(plan, shared, corpus.held_out.size(), interrupts);
  const auto run_start = std::chrono::steady_clock::now();
  twobp::run_ranks(job.run_options(), [&](twobp::Transport& transport) {
    train_rank(plan, transport, job.device_of(transport), corpus.tokens, corpus.held_out, shared);
  });

  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  if (my_rank != 0) return interrupts.exit_status();
  std::vector<std::string> written;
  if (!args.dump_schedule.empty()) written.push_back(args.dump_schedule);
  if (!args.checkpoint_dir.empty() && !shared.records.empty()) written.push_back(args.checkpoint_dir + "/");
  if (!shared.exported.empty()) written.push_back(args.export_hf + "/");
  // Costs are measured from a run's second step: an interrupted run of one step wrote none.
  if (!args.costs_json.empty() && shared.records.size() >= (interrupts.received() != 0 ? 2u : 1u)) {
    written.push_back(args.costs_json);
  }
  if (!args.trace.empty()) {
    twobp::write_file(args.trace, twobp::to_chrome_trace(shared.traces), "--trace");
    fmt::print("trace of the last step written to {}\n", args.trace);
    written.push_back(args.trace);
  }
  if (!args.json.empty()) {
    nlohmann::json j = run_json(plan, shared, corpus.held_out.size());
    j["complete"] = true;
    twobp::cli::write_json(args.json, j);
    written.push_back(args.json);
  }
  print_summary(shared.records, shared.attribution, wall_s, written);
  if (interrupts.received() != 0) {
    const int done = shared.records.empty() ? static_cast<int>(shared.resumed_from) : shared.records.back().step + 1;
    fmt::print("interrupted by {} after step {} of {}: {}; exit status {}\n",
               interrupts.received_name(), done, args.steps,
               written.empty() ? std::string("nothing to write") : fmt::format("wrote {}", fmt::join(written, ", ")),
               interrupts.exit_status());
  }
  return interrupts.exit_status();
}

}  // namespace
}  // namespace llama_example

namespace {

int run_main(int argc, char** argv) {
  // Before anything touches CUDA: NcclTransport requires eager kernel loading (its class comment says why); a
  // value the user set is kept (and a LAZY one refused by the transport with what to do).
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  llama_example::Args a;
  CLI::App app{"Pipeline-parallel training of a LLaMa-like model with 2-stage backpropagation"};
  llama_example::add_options(app, a);
  if (const std::optional<int> status = twobp::cli::parse(app, argc, argv)) return *status;
  a.ignored = llama_example::ignored_options(app, a);
  a.ranks_given = app.count("--ranks") > 0;
  a.model_given = app.count("--model") > 0;
  try {
    return llama_example::run(a, argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "llama_pipeline: error: {}\n", twobp::cli::error_message(e));
    return twobp::cli::failure_status(e);
  }
}

}  // namespace

// Static objects are left to the operating system: LibTorch's teardown costs each run ~0.2 s (launch.h).
int main(int argc, char** argv) { twobp::exit_without_teardown(run_main(argc, argv)); }
