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
// smallest program to start from, see examples/minimal. This file launches the ranks and writes the outputs; the
// command line, the plan and the training of a rank have files of their own (example.h lists them).
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

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <csignal>
#include <fstream>
#include <memory>
#include <thread>

#include "example.h"
#include "twobp/config.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/metrics/memory.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/mpi_launch.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/text.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/local.h"
#include "twobp/transport/mpi.h"
#include "twobp/transport/nccl.h"
#include "twobp/transport/store.h"
#include "twobp_cli.h"  // examples/common: option checks shared with twobp_bench

namespace llama_example {
namespace {

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
  if (!mpi && !store) twobp::cli::check_rank_threads(args.dp, args.stages);
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
               layout.dp, layout.pp, plan.schedule.num_stages,
               args.auto_schedule() ? "auto, starting with " + plan.schedule.name : plan.schedule.name,
               twobp::to_string(plan.schedule.backward),
               plan.partition.layout(), args.microbatches, args.micro_batch_size, plan.seq_len,
               args.pack ? " (packed documents)" : "",
               args.seq_len_warmup > 0 ? fmt::format(" (length warm-up over {} steps)", args.seq_len_warmup) : "",
               args.device, args.dtype);
  }

  Shared shared;
  const bool processes = mpi || store;
  // A node's cores are shared by its ranks -- this process's rank threads, or the launcher's processes on this
  // node -- each taking its share (every process taking all of them oversubscribes the node local_size times).
  int ranks_on_node = world;
  if (store) ranks_on_node = launch->local_size;
#if TWOBP_HAVE_MPI
  if (mpi) ranks_on_node = twobp::mpi_launch_env(*env).local_size;
#endif
  torch::set_num_threads(
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, ranks_on_node)));
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
  // From here Ctrl-C and `kill` end the run after the step in progress, with its outputs (see the end of run()).
  twobp::InterruptGuard interrupts;
  shared.interrupts = &interrupts;
  const auto run_start = std::chrono::steady_clock::now();
  twobp::run_ranks(launch_options, [&](twobp::Transport& transport) {
    // Compute where the transport's wire is (NCCL), else on a GPU of our own (thread ranks share the GPUs) or CPU.
    const c10::Device device = transport.device().is_cuda() ? transport.device()
                               : cuda && !processes ? c10::Device(c10::kCUDA, transport.rank() % gpus)
                                      : c10::Device(c10::kCPU);
    train_rank(plan, transport, device, tokens, held_out, shared);
  });

  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  if (my_rank != 0) return interrupts.exit_status();
  std::vector<std::string> written;
  if (!args.dump_schedule.empty()) written.push_back(args.dump_schedule);
  if (!args.checkpoint_dir.empty() && !shared.records.empty()) written.push_back(args.checkpoint_dir + "/");
  // Costs are measured from a run's second step: an interrupted run of one step wrote none.
  if (!args.costs_json.empty() && shared.records.size() >= (interrupts.received() != 0 ? 2u : 1u)) {
    written.push_back(args.costs_json);
  }
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
                            {"final",
                             {{"schedule", shared.final_schedule},
                              {"2bp", shared.final_two_bp},
                              {"recompute_ranks", shared.final_recompute_ranks},
                              {"chunks_per_rank", shared.final_chunks_per_rank},
                              {"partition", shared.final_partition}}}};
    }
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
      if (r.memory_limit_held) step["memory_limit_held"] = *r.memory_limit_held;
      if (r.eval_loss) {
        step["eval_loss"] = *r.eval_loss;
        step["eval_perplexity"] = std::exp(*r.eval_loss);
      }
      j["steps"].push_back(step);
    }
    write_json(args.json, j);
    written.push_back(args.json);
  }
  print_summary(shared.records, shared.attribution, wall_s, written);
  if (interrupts.received() != 0) {
    const int done = shared.records.empty() ? static_cast<int>(shared.resumed_from) : shared.records.back().step + 1;
    fmt::print("interrupted by {} after step {} of {}: {}; exit status {}\n",
               interrupts.received() == SIGINT ? "SIGINT" : "SIGTERM", done, args.steps,
               written.empty() ? std::string("nothing to write") : fmt::format("wrote {}", fmt::join(written, ", ")),
               interrupts.exit_status());
  }
  return interrupts.exit_status();
}

}  // namespace
}  // namespace llama_example

int main(int argc, char** argv) {
  // Before anything touches CUDA: NcclTransport requires eager kernel loading (its class comment says why); a
  // value the user set is kept (and a LAZY one refused by the transport with what to do).
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  llama_example::Args a;
  CLI::App app{"Pipeline-parallel training of a LLaMa-like model with 2-stage backpropagation"};
  llama_example::add_options(app, a);
  if (const std::optional<int> status = twobp::cli::parse(app, argc, argv)) return *status;
  a.ignored = llama_example::ignored_options(app, a);
  a.ranks_given = app.count("--ranks") > 0;
  try {
    return llama_example::run(a, argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "llama_pipeline: error: {}\n", twobp::cli::error_message(e));
    return dynamic_cast<const twobp::Error*>(&e) != nullptr ? 2 : 1;
  }
}
