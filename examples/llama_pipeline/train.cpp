// One rank of llama_pipeline: its chunks, the pipeline, AdamW and the training loop.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "example.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/files.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/metrics.h"
#include "twobp/models/llama_rank.h"
#include "twobp/plan/choose.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/record.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/lr_schedule.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/transport/collectives.h"

namespace llama_example {
namespace {

/// AdamW over this rank's parameters: sharded over the replicas with --zero 1 or 2, over this rank alone (no group: it
/// owns every parameter, a plain AdamW) otherwise, so both go through one code path.
using Optimizer = twobp::ShardedOptimizer;

/// This rank's chunks, on `device`, in a Pipeline over the replica's ranks (twobp/models/llama_rank.h); `named`
/// holds the checkpoint's names of their tensors (the float32 masters under mixed precision).
using RankModel = llm::LlamaRank;

RankModel build_rank_model(const Plan& p, twobp::ParallelGroups& groups, c10::Device device,
                           twobp::Duration timeout) {
  const Args& a = p.args;
  twobp::Transport& transport = groups.pipeline();
  llm::LlamaRankOptions o{p.config, p.partition, a.seed, a.micro_batch_size, p.seq_len, p.precision, a.pack};
  o.fixed_shapes = a.seq_len_warmup == 0;  // a sequence-length warm-up changes the shapes every step
  o.device = device;
  o.recompute = twobp::has_rank(p.recompute_ranks, transport.rank());
  twobp::PipelineOptions po;
  po.executor.timeout = timeout;
  po.data_parallel.group = groups.data_parallel();
  po.data_parallel.zero = twobp::parse_zero_stage(std::to_string(a.zero));  // 2: gradients sharded by the Pipeline
  po.executor.max_pending_weight_micro_batches = a.max_pending_w;
  // Tensor memory of the device the chunks compute on, recorded every step (and bounded with --memory-limit-gb).
  // Not where rank threads share a GPU: its allocator statistics are the whole process's (the Pipeline refuses).
  const bool shared_device = !device.is_cpu() && transport.ranks_sharing_device() > 1;
  EXAMPLE_CHECK(!shared_device || a.memory_limit_gb <= 0, twobp::UsageError,
              "--memory-limit-gb: {} rank threads share {}, whose memory statistics are the whole process's; run one "
              "rank per GPU (fewer --ranks, or a launcher)",
              transport.ranks_sharing_device(), device.str());
  po.executor.record_memory = !shared_device;
  po.executor.memory_device = device;
  po.executor.memory_limit_bytes = a.memory_limit_bytes();
  return llm::build_llama_rank(p.schedule, transport, o, po);
}

/// Where this rank's share of every global batch comes from, and which ends of the pipeline it feeds.
struct RankData {
  twobp::data::BatchSampler train;
  std::optional<twobp::data::BatchSampler> held_out;  // --eval-every: the same batches of the held-out split
  int64_t replica_batch = 0;                           // sequences per replica and step
  int64_t share = 0;                                   // this replica's first row of a global batch
  bool owns_first = false, owns_last = false;

  llm::LlamaRankBatch batch(const Args& a, const twobp::data::Batch& b, int64_t len) const {
    return llm::llama_rank_batch(b.inputs, b.targets, share, replica_batch, len, owns_first, owns_last, a.pack,
                                 a.doc_separator);
  }
  /// The token mean of the loss over --eval-batches held-out global batches (Pipeline::evaluate: forward only, eval
  /// mode; each batch's token mean weighed by its tokens, as training weighs them). A signal stops it between
  /// batches (agreed over `world`, every rank after the same batch): the mean of those done.
  double evaluate(const Args& a, twobp::Pipeline& pipeline, int64_t seq, twobp::Transport& world,
                  twobp::InterruptGuard* interrupts, twobp::Duration timeout) const {
    double sum = 0.0, tokens = 0.0;
    int k = 0;
    while (k < a.eval_batches) {
      const twobp::data::Batch global = held_out->batch(k);
      const llm::LlamaRankBatch b = batch(a, global, seq);
      // Every rank draws the global batch: its tokens are counted here, with --pack those the loss mask keeps.
      const at::Tensor ids = global.inputs.narrow(1, 0, seq), next = global.targets.narrow(1, 0, seq);
      const double n = a.pack ? llm::packed_targets(ids, next, a.doc_separator)[llm::kLossMask].sum().item<double>()
                              : static_cast<double>(ids.numel());
      sum += n * pipeline.evaluate(b.inputs, b.targets);
      tokens += n;
      ++k;
      if (k < a.eval_batches && interrupts != nullptr && interrupts->agreed(world, timeout)) {
        if (world.rank() == 0) fmt::print("evaluation stopped by the interrupt after {} of {} batches\n", k,
                                          a.eval_batches);
        break;
      }
    }
    return sum / tokens;
  }
};

/// What a step measured on every rank (the peak over the pipeline's ranks, the job's energy), printed by rank 0
/// and kept for the JSON.
void report_step(const Plan& p, twobp::Transport& world, twobp::Transport& pipeline_ranks, StepRecord record,
                 const twobp::StepResult& result, double step_s, double elapsed_s, int start, int end,
                 std::optional<double> energy_j, double tokens, twobp::Duration timeout, Shared& shared) {
  record.peak_memory_bytes =
      twobp::max_over_ranks(pipeline_ranks, static_cast<double>(result.peak_memory_bytes), timeout);
  const int64_t limit = p.args.memory_limit_bytes();
  if (limit > 0 && record.peak_memory_bytes >= 0) {
    record.memory_limit_held = record.peak_memory_bytes <= static_cast<double>(limit);
  }
  record.energy_j = twobp::energy::job_energy(world, energy_j, timeout);
  if (record.energy_j) record.j_per_token = twobp::metrics::per_item(*record.energy_j, tokens);
  record.tokens_per_s = twobp::metrics::per_second(tokens, step_s);
  if (world.rank() != 0) return;
  const double remaining = elapsed_s / (record.step - start + 1) * (end - record.step - 1);
  fmt::print("{}\n", twobp::metrics::format_step(record, p.args.steps, elapsed_s, remaining, limit));
  std::lock_guard<std::mutex> lock(shared.mutex);
  if (record.memory_limit_held == false && !shared.memory_limit_noted) {
    shared.memory_limit_noted = true;
    fmt::print("note: the memory limit ({:.3g} MiB per rank, --memory-limit-gb) was exceeded: it moves deferred W's "
               "earlier, nothing else, so what the schedule holds without them (activations, gradients) is not "
               "bounded, and a first step has no measurement to plan with yet; a lower-memory schedule (v-half, "
               "v-min), --recompute or fewer --microbatches lower the rest\n",
               limit / (1024.0 * 1024.0));
  }
  std::fflush(stdout);
  shared.records.push_back(record);
}

/// Weights and AdamW state of every replica's stages, by global name (collective; replica 0 writes).
void save(const Plan& p, const std::string& dir, const ck::NamedTensors& named, Optimizer& optimizer,
          twobp::ParallelGroups& groups, int steps_done, twobp::Duration timeout) {
  ck::NamedTensors state = named;
  auto opt = optimizer.gathered_adamw_state(named);  // collective over the replicas when sharded
  state.insert(state.end(), opt.begin(), opt.end());
  ck::CheckpointConfig config = p.checkpoint_config;
  config.insert(p.checkpoint_layout.begin(), p.checkpoint_layout.end());
  const ck::DataParallelCheckpoint replicas{p.dp, groups.replica(), groups.data_parallel()};
  ck::save_checkpoint(dir, steps_done, config, state, groups.pipeline(), timeout, replicas);
}

/// This rank's model, optimizer and data of one placement (what a move between placements rebuilds).
struct RankState {
  Plan plan;  // the placement, schedule and recomputation running now
  RankModel model;
  std::unique_ptr<Optimizer> optimizer;
  RankData data;
  int moves = 0;  // between placements, so far
  int steps_done = 0;  // the steps run so far (the step a move's checkpoint holds)
  twobp::Pipeline& pipeline() { return *model.pipeline; }
};

/// Builds `state.plan`'s chunks of this rank with their Pipeline and AdamW, and notes which ends of the pipeline
/// the rank feeds.
void build(RankState& state, twobp::ParallelGroups& groups, c10::Device device, twobp::Duration timeout) {
  const Plan& p = state.plan;
  state.model = build_rank_model(p, groups, device, timeout);
  const auto options = torch::optim::AdamWOptions(p.args.lr).betas({0.9, 0.95}).weight_decay(p.args.weight_decay);
  // Each tensor once (pipeline.parameters()): with tied embeddings the head chunk lists its table under two names.
  // --zero 1 shards over the pipeline's data-parallel group, its broadcasts waits of the job's hang report.
  const Optimizer::Factory adamw = [options](std::vector<at::Tensor> owned) {
    return std::unique_ptr<torch::optim::Optimizer>(std::make_unique<torch::optim::AdamW>(std::move(owned), options));
  };
  // --zero 2: the same optimizer steps the pipeline's gradient shards (DataParallelOptions::zero).
  state.optimizer = p.args.zero >= 1
                        ? std::make_unique<Optimizer>(state.pipeline(), adamw)
                        : std::make_unique<Optimizer>(state.pipeline().parameters(), nullptr, adamw, timeout);
  state.data.owns_first = p.schedule.stage_to_rank.front() == groups.pipeline().rank();
  state.data.owns_last = p.schedule.stage_to_rank.back() == groups.pipeline().rank();
}

/// Loads the weights and this rank's share of the AdamW state from the checkpoint in `dir`, by global name (any
/// layout); returns its step.
int64_t load_state(const std::string& dir, RankState& state, twobp::ParallelGroups& groups) {
  auto loaded = ck::load_checkpoint_by_name(
      dir, state.plan.checkpoint_config, ck::state_of(state.model.named),
      fmt::format("rank {} (replica {})", groups.pipeline().rank(), groups.replica()));
  ck::restore(loaded.tensors, state.model.named, nullptr);
  state.optimizer->restore_adamw_state(loaded.tensors, state.model.named);
  return loaded.step;
}

/// --auto-placements: the move to another placement (twobp::PlacementSearch::Rebuild), collective over the job:
/// the weights and AdamW state saved by global name (a checkpoint in --checkpoint-dir/placement), this rank's
/// chunks of `to` built with their Pipeline and optimizer, and the state loaded into them, as --resume does.
twobp::Pipeline& move_to(const twobp::Placement& to, RankState& state, twobp::ParallelGroups& groups,
                         c10::Device device, twobp::Duration timeout) {
  const std::string dir = state.plan.args.checkpoint_dir + "/placement";
  save(state.plan, dir, state.model.named, *state.optimizer, groups, state.steps_done, timeout);
  state.optimizer.reset();  // the old placement's memory goes before the new one's is allocated
  state.model = RankModel{};
  state.plan = with_placement(state.plan, to);
  build(state, groups, device, timeout);
  load_state(dir, state, groups);
  ++state.moves;
  return state.pipeline();
}

/// --costs-json: the run's per-stage costs, agreed over the pipeline's ranks and the replicas, and the time of one
/// activation message, as a run document (twobp/plan/record.h): the model's sizes and one record of the run's
/// placement and partition with every cost it measured -- a 2BP record (F, I, W; B too where standard steps measured
/// it on every stage, as --schedule auto does), else a standard one (F, B) -- from which `twobp_bench plan
/// --costs-json` fits per-chunk costs and plans any placement. No record when neither mode's costs cover every stage
/// (a stage without them would read as free to the fit). Collective over the pipeline (and the replicas); world
/// rank 0 writes.
void write_costs(const Plan& p, twobp::ParallelGroups& groups, const twobp::CostRecorder& recorder,
                 const std::string& schedule, c10::Device device, bool writes, twobp::Duration timeout) {
  twobp::Transport& transport = groups.pipeline();
  twobp::RunRecord r;
  r.costs = twobp::agree_costs(transport, recorder.local_medians(), timeout, groups.data_parallel());
  const llm::LlamaConfig& c = p.config;
  const at::Tensor activation =
      at::empty({p.args.micro_batch_size, p.seq_len, c.dim},
                at::TensorOptions().dtype(twobp::compute_dtype(p.precision)).device(device));
  r.costs.communication = twobp::measure_message_ms(transport, activation, timeout);
  if (!writes) return;
  twobp::RunDocument doc;
  doc.model = {"llama", c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, p.seq_len,
               p.args.micro_batch_size};
  doc.config_extra = nlohmann::ordered_json{{"source", "llama_pipeline --costs-json"}, {"dtype", p.args.dtype},
                                            {"device", device.str()}, {"steps_measured", recorder.steps()}}
                         .dump();
  if (const std::optional<twobp::BackwardMode> mode = twobp::measured_mode(r.costs)) {
    r.schedule = schedule;
    r.mode = *mode;
    r.p = p.world_size;
    r.v = p.schedule.num_stages / p.world_size;
    r.m = p.args.microbatches;
    r.partition = p.partition.layout();
    r.replicas = p.dp;
    doc.results.push_back(std::move(r));
  }
  twobp::write_file(p.args.costs_json, twobp::write_run_document(doc) + "\n", "--costs-json");
}


/// --schedule auto (twobp::LlamaAutoTuner): AutoSchedule chooses among the starting placement's forms; with
/// --auto-placements the forms of other placements the planner predicts fastest are measured too, the state moving
/// between them through move_to.
void make_tuner(std::optional<twobp::LlamaAutoTuner>& tuner, RankState& state, twobp::ParallelGroups& groups,
                c10::Device device, twobp::Duration timeout) {
  const Args& a = state.plan.args;
  if (!a.auto_schedule()) return;
  twobp::LlamaAutoOptions o;
  twobp::AutoScheduleOptions& so = o.schedule;
  so.probe_steps = so.verify_steps = a.auto_steps;
  so.measure_candidates = a.auto_candidates;
  so.measure_within = a.auto_within;
  // Needs the per-action memory readings, which rank threads sharing a GPU do not take (build_rank_model).
  EXAMPLE_CHECK(a.auto_memory_limit_gb <= 0 || state.pipeline().options().executor.record_memory, twobp::UsageError,
              "--auto-memory-limit-gb: rank {}'s memory is not measured per action (rank threads sharing {}, whose "
              "memory statistics are the whole process's); run one rank per GPU",
              groups.pipeline().rank(), device.str());
  so.memory_limit_bytes = a.auto_memory_limit_gb * 1024.0 * 1024.0 * 1024.0;
  so.recompute = a.auto_recompute;
  so.probe_weight_sizes = a.auto_weight_sizes;
  so.replicas = groups.data_parallel();
  so.timeout = timeout;
  o.placements = a.auto_placements;
  o.plan = {a.micro_batch_size, state.plan.seq_len, state.plan.precision, a.auto_recompute, so.memory_limit_bytes};
  o.device = device;
  tuner.emplace(state.pipeline(), state.plan.config, placement_of(state.plan), o,
                [&state, &groups, device, timeout](const twobp::Placement& to) -> twobp::Pipeline& {
                  return move_to(to, state, groups, device, timeout);
                });
}

/// --costs-json: every full-length step's actions after the run's first (warm-up); after a move to another
/// placement, its stages' from its second step.
struct CostsWindow {
  std::optional<twobp::CostRecorder> recorder;
  int from = 0;   // the first step recorded
  int moves = 0;  // the moves seen

  CostsWindow(const Plan& p, int start, int end) : from(start + 1) {
    if (p.args.costs_json.empty()) return;
    EXAMPLE_CHECK(end - start >= 2, twobp::UsageError,
                "--costs-json measures the steps after this run's first (warm-up); this run has {} step(s): give "
                "--steps (and --stop-after) for at least 2",
                end - start);
    recorder.emplace(p.schedule.num_stages);
  }
  void add(int step, bool full_length, const twobp::Trace& trace) {
    if (recorder && step >= from && full_length) recorder->add(trace);
  }
  void follow(const RankState& state, int step) {
    if (!recorder || state.moves == moves) return;
    recorder.emplace(state.plan.schedule.num_stages);
    moves = state.moves;
    from = step + 2;
  }
};

/// Where the step's time went on this rank: from the pipeline's start to the optimizer's end (the gradient gate,
/// clipping and update included).
twobp::StepAttribution attribute(const twobp::Schedule& schedule, const twobp::StepResult& result,
                                 std::chrono::steady_clock::time_point step_start,
                                 std::chrono::steady_clock::time_point step_end) {
  const auto optimizer_end = std::chrono::steady_clock::now();
  twobp::StepTimes times;
  times.pipeline_us = result.pipeline_us;
  times.reduce_wait_us = result.reduce_wait_us;
  times.optimizer_us = std::chrono::duration<double, std::micro>(optimizer_end - step_end).count();
  times.step_us = std::chrono::duration<double, std::micro>(optimizer_end - step_start).count();
  return twobp::attribute_step(schedule, result.trace, times);
}

/// The run's end on every rank (collective): --costs-json, and what rank 0 reports (the final schedule and
/// placement, where each rank's step time went, the optimizer state each rank holds).
void finish_rank(RankState& state, twobp::ParallelGroups& groups, twobp::Transport& world, const CostsWindow& costs,
                 const std::vector<twobp::StepAttribution>& attributions, c10::Device device, twobp::Duration timeout,
                 Shared& shared) {
  const bool reports = world.rank() == 0;
  // Interrupted before a full-length step after the first was measured: no costs to write (said by main()).
  const bool interrupted_early = costs.recorder && costs.recorder->steps() == 0 && shared.interrupts != nullptr &&
                                 shared.interrupts->received() != 0;
  if (costs.recorder && !interrupted_early) {
    EXAMPLE_CHECK(costs.recorder->steps() > 0, twobp::UsageError,
                "--costs-json: no full-length step after the first was measured (--seq-len-warmup {} covers the "
                "run's steps); run more steps",
                state.plan.args.seq_len_warmup);
    write_costs(state.plan, groups, *costs.recorder, state.pipeline().schedule().name, device, reports, timeout);
  }
  std::vector<twobp::StepAttribution> ranks;
  if (!attributions.empty()) {  // every rank ran the same steps: all of a pipeline call this, or none
    ranks = twobp::gather_attributions(groups.pipeline(), twobp::mean_attribution(attributions), timeout);
  }
  // The optimizer state each rank holds (with --zero 1, its share), every world rank's in its slot.
  std::vector<double> state_bytes =
      twobp::gather_over_ranks(world, static_cast<double>(state.optimizer->state_bytes()), timeout);
  if (!reports) return;
  std::lock_guard<std::mutex> lock(shared.mutex);
  shared.final_placement = placement_of(state.plan);
  if (!ranks.empty()) shared.attribution = std::move(ranks);
  shared.optimizer_state_bytes = std::move(state_bytes);
}

// The tuner's decisions after a step (a switch lands on the step boundary: the record of the step is taken);
// rank 0 prints and keeps them.
void follow_tuner(std::optional<twobp::LlamaAutoTuner>& tuner, RankState& state, const twobp::StepResult& result,
                  int step, bool reports, Shared& shared) {
  if (!tuner) return;
  for (const std::string& news : tuner->after_step(result)) {
    state.plan = with_placement(state.plan, tuner->running());
    if (!reports) continue;
    fmt::print("{}\n", news);
    std::lock_guard<std::mutex> lock(shared.mutex);
    shared.auto_decisions.emplace_back(step, news);
    shared.auto_ranking = tuner->ranking();
  }
}

// Energy of the device the chunks compute on (NVML) or of the node's CPUs (RAPL), summed over the job; rank 0 says
// where the run starts.
twobp::energy::RankEnergy open_energy(const Args& a, twobp::Transport& world, c10::Device device, int start,
                                      Shared& shared) {
  twobp::energy::EnergyOptions energy_options;
  energy_options.powercap_root = a.powercap_root;
  twobp::energy::RankEnergy rank_energy = twobp::energy::rank_energy(world, device, energy_options);
  if (world.rank() == 0) {
    if (a.resume && a.steps == 0) fmt::print("loaded the checkpoint of step {} ({})\n", start, a.checkpoint_dir);
    if (a.resume && a.steps > 0) fmt::print("resuming from step {} of {} ({})\n", start, a.steps, a.checkpoint_dir);
    std::lock_guard<std::mutex> lock(shared.mutex);
    shared.resumed_from = start;
    shared.energy_source = rank_energy.source();
    shared.energy_note = rank_energy.note();
  }
  return rank_energy;
}

// After step `step`: the traces at the last step (every rank's, gathered: collective), the checkpoint when due.
void write_step_outputs(RankState& state, twobp::ParallelGroups& groups, twobp::Transport& world,
                        const twobp::Trace& trace, int step, bool last, twobp::Duration timeout, Shared& shared) {
  const Args& a = state.plan.args;
  const bool reports = world.rank() == 0;
  if (!a.trace.empty() && last) {
    // Every rank's trace on every rank (collective), so rank 0 writes them all, threads or processes.
    std::vector<twobp::Trace> traces = twobp::gather_traces(world, trace, timeout);
    std::lock_guard<std::mutex> lock(shared.mutex);
    if (reports) shared.traces = std::move(traces);
  }
  const bool periodic = a.checkpoint_every > 0 && (step + 1) % a.checkpoint_every == 0;
  if (!a.checkpoint_dir.empty() && (periodic || last)) {
    save(state.plan, a.checkpoint_dir, state.model.named, *state.optimizer, groups, step + 1, timeout);
    if (reports) fmt::print("checkpoint of step {} written to {}\n", step + 1, a.checkpoint_dir);
  }
}

}  // namespace

void train_rank(const Plan& p, twobp::Transport& world, c10::Device device, const twobp::data::Tokens& tokens,
                const twobp::data::Tokens& held_out, Shared& shared) {
  const Args& a = p.args;
  const auto timeout = twobp::Duration(static_cast<int64_t>(a.timeout_s * 1000));
  // The pipeline of this rank's replica, and the group of the same stages in every replica (dp > 1).
  twobp::ParallelGroups groups(world, p.dp, timeout);
  twobp::Transport& transport = groups.pipeline();
  const bool reports = world.rank() == 0;
  // One global batch per step, the same for every --dp; replica d trains on its d-th share.
  const int64_t replica_batch = a.microbatches * a.micro_batch_size, global_batch = p.dp * replica_batch;
  RankState state{p, {}, nullptr,
                  RankData{twobp::data::BatchSampler(tokens, p.seq_len, global_batch, a.seed), std::nullopt,
                           replica_batch, groups.replica() * replica_batch}};
  build(state, groups, device, timeout);
  if (a.eval_every > 0) state.data.held_out.emplace(held_out, p.seq_len, global_batch, a.seed);
  const int start = a.resume ? static_cast<int>(load_state(a.checkpoint_dir, state, groups)) : 0;
  if (!a.init_from.empty()) load_hf_weights(p, state.model.named, reports);
  twobp::energy::RankEnergy rank_energy = open_energy(a, world, device, start, shared);
  const int end = a.stop_after > 0 ? std::min(a.stop_after, a.steps) : a.steps;
  std::optional<twobp::LlamaAutoTuner> tuner;
  make_tuner(tuner, state, groups, device, timeout);
  CostsWindow costs(p, start, end);
  std::vector<twobp::StepAttribution> attributions;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = start; step < end; ++step) {
    if (reports && shared.progress) shared.progress(step, end);  // --json of the steps done; what a signal finishes
    twobp::Pipeline& pipeline = state.pipeline();  // this step's (a move between steps builds another)
    const auto ts = std::chrono::steady_clock::now();
    const std::optional<double> e0 = rank_energy.share();
    // Linear warm-up over --warmup-steps, then cosine decay to 10 % of --lr at --steps.
    const double lr = twobp::WarmupCosine{a.lr, a.steps, a.warmup_steps, 0.1}.at(step);
    state.optimizer->set_lr(lr);
    pipeline.zero_grad();
    // The step's sequence length (shorter during --seq-len-warmup): a prefix of the full-length windows, so the
    // batch of a step still depends only on (--seed, step).
    const int64_t len = twobp::data::warmup_seq_len(p.seq_len, step, a.seq_len_warmup);
    const llm::LlamaRankBatch batch = state.data.batch(a, state.data.train.batch(step), len);
    const auto step_start = std::chrono::steady_clock::now();
    const twobp::StepResult result = pipeline.step(batch.inputs, batch.targets);
    const auto step_end = std::chrono::steady_clock::now();
    costs.add(step, len == p.seq_len, result.trace);
    // The gate: no optimizer step on a NaN or Inf loss or gradient (--on-nonfinite stop: NumericalError naming the
    // step and stages; skip: this step's update is dropped on every rank), gradients clipped to --clip (0: not).
    const bool updated = pipeline.ready_for_optimizer(
        step + 1, a.on_nonfinite == "skip" ? twobp::NonFinitePolicy::kSkipStep : twobp::NonFinitePolicy::kStop,
        a.clip);
    if (updated) state.optimizer->step();
    if (step > start || end - start == 1) {
      attributions.push_back(attribute(pipeline.schedule(), result, step_start, step_end));
    }
    // The record first: a move to another placement below replaces the pipeline. Then the tuner's decisions,
    // after the step's own accounting (which reads the schedule it ran): a switch lands on the step boundary.
    StepRecord record{step, pipeline.mean_loss(result), 0, pipeline.last_gradient_check().norm, lr, 0};
    record.skipped = !updated;
    state.steps_done = step + 1;
    follow_tuner(tuner, state, result, step, reports, shared);
    costs.follow(state, step);
    // SIGINT/SIGTERM (collective over the world): every rank makes this step its last -- evaluation, trace and
    // checkpoint as at the end -- so that the outputs of the steps done are written.
    const bool interrupted = shared.interrupts != nullptr && shared.interrupts->agreed(world, timeout);
    const bool last = step + 1 == end || interrupted;
    // Held-out loss of the updated weights.
    if (state.data.held_out && ((step + 1) % a.eval_every == 0 || last)) {
      record.eval_loss = state.data.evaluate(a, state.pipeline(), p.seq_len, world, shared.interrupts, timeout);
    }
    const std::optional<double> e1 = rank_energy.share();
    const auto now = std::chrono::steady_clock::now();
    report_step(p, world, transport, record, result, std::chrono::duration<double>(now - ts).count(),
                std::chrono::duration<double>(now - t0).count(), start, end,
                e0 && e1 ? std::optional<double>(*e1 - *e0) : std::nullopt, static_cast<double>(global_batch * len),
                timeout, shared);
    write_step_outputs(state, groups, world, result.trace, step, last, timeout, shared);
    if (interrupted) break;
  }
  finish_rank(state, groups, world, costs, attributions, device, timeout, shared);
  if (!a.export_hf.empty()) {
    export_hf_model(state.plan, state.model.named, groups.pipeline(), groups.replica(), timeout, shared);
  }
}

void print_summary(const std::vector<StepRecord>& records, const std::vector<twobp::StepAttribution>& attribution,
                   double wall_s, const std::vector<std::string>& written) {
  if (records.empty()) return;
  for (const std::string& line : twobp::metrics::summarize_steps(records, wall_s)) fmt::print("{}\n", line);
  if (!attribution.empty()) {
    fmt::print("where each rank's step went (mean over {} steps; replica 0):\n",
               records.size() > 1 ? records.size() - 1 : records.size());
    for (const twobp::StepAttribution& a : attribution) fmt::print("  {}\n", twobp::format_attribution(a));
  }
  if (!written.empty()) fmt::print("files written: {}\n", fmt::join(written, ", "));
}

}  // namespace llama_example
