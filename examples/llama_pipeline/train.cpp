// One rank of llama_pipeline: its chunks, the pipeline, AdamW and the training loop.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "example.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/metrics.h"
#include "twobp/plan/choose.h"
#include "twobp/plan/measure.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/transport/collectives.h"

namespace llama_example {
namespace {

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
/// This rank's chunks (built here only), on `device`, in a Pipeline over the replica's ranks; `named` holds the
/// checkpoint's names of their tensors (the float32 masters under mixed precision).
struct RankModel {
  std::unique_ptr<twobp::Pipeline> pipeline;
  ck::NamedTensors named;
};

RankModel build_rank_model(const Plan& p, twobp::ParallelGroups& groups, c10::Device device,
                           twobp::Duration timeout) {
  const Args& a = p.args;
  twobp::Transport& transport = groups.pipeline();
  const int last = p.schedule.num_stages - 1;
  RankModel model;
  std::vector<twobp::PipelineChunk> chunks;
  const c10::Device wire = transport.device();
  for (int s : p.schedule.stages_of(transport.rank())) {
    llm::LlamaChunk chunk(p.config, p.partition.chunks[s], a.seed);
    // Mixed precision: built in float32; the Pipeline keeps float32 masters and converts the chunk to bfloat16.
    const bool masters = p.precision == twobp::Precision::kMixedBFloat16;
    chunk->to(device, masters ? at::kFloat : twobp::compute_dtype(p.precision));
    for (auto& t : ck::module_tensors(*chunk)) model.named.push_back(t);
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
  const bool recompute = twobp::has_rank(p.recompute_ranks, transport.rank());
  for (auto& chunk : chunks) chunk.recompute = recompute;
  twobp::PipelineOptions po;
  po.executor.timeout = timeout;
  const int64_t mbs = a.micro_batch_size, seq = p.seq_len, dim = p.config.dim;
  const auto dtype = twobp::compute_dtype(p.precision);
  // Fixed shapes give every boundary a spec; with a sequence-length warm-up they change from step to step, so the
  // senders announce them instead (PipelineOptions::executor.activation_spec).
  if (a.seq_len_warmup == 0 && a.pack) {
    po.executor.boundary_spec = [=](int) {
      return twobp::BoundarySpec{{{mbs, seq, dim}, dtype, llm::kHidden},
                                 {{mbs, seq}, at::kLong, llm::kPositions, false},
                                 {{mbs, seq}, at::kLong, llm::kDocIds, false}};
    };
  } else if (a.seq_len_warmup == 0) {
    po.executor.activation_spec = [=](int) { return twobp::TensorSpec{{mbs, seq, dim}, dtype}; };
  }
  if (a.pack) {
    po.loss = llm::masked_cross_entropy_loss;
  } else {
    po.loss = [](const at::Tensor& logits, const at::Tensor& targets) {
      return llm::cross_entropy_loss(logits, targets.to(logits.device()));
    };
  }
  po.data_parallel.group = groups.data_parallel();
  po.executor.max_pending_weight_micro_batches = a.max_pending_w;
  // Tensor memory of the device the chunks compute on, recorded every step (and bounded with --memory-limit-gb).
  // Not where rank threads share a GPU: its allocator statistics are the whole process's (the Pipeline refuses).
  const bool shared_device = !device.is_cpu() && transport.ranks_sharing_device() > 1;
  TWOBP_CHECK(!shared_device || a.memory_limit_gb <= 0, twobp::UsageError,
              "--memory-limit-gb: {} rank threads share {}, whose memory statistics are the whole process's; run one "
              "rank per GPU (fewer --ranks, or a launcher)",
              transport.ranks_sharing_device(), device.str());
  po.executor.record_memory = !shared_device;
  po.executor.memory_device = device;
  po.executor.memory_limit_bytes = a.memory_limit_bytes();
  if (p.precision == twobp::Precision::kMixedBFloat16) po.mixed_precision.compute_dtype = at::kBFloat16;
  model.pipeline = std::make_unique<twobp::Pipeline>(p.schedule, std::move(chunks), transport, po);
  // With mixed precision the optimizer and the checkpoints hold the float32 masters.
  for (auto& entry : model.named) entry.second = model.pipeline->master_weight(entry.second);
  return model;
}

/// Where this rank's share of every global batch comes from, and which ends of the pipeline it feeds.
struct RankData {
  twobp::data::BatchSampler train;
  std::optional<twobp::data::BatchSampler> held_out;  // --eval-every: the same batches of the held-out split
  int64_t replica_batch = 0;                           // sequences per replica and step
  int64_t share = 0;                                   // this replica's first row of a global batch
  bool owns_first = false, owns_last = false;

  RankBatch batch(const Args& a, int step, int64_t len) const {
    return rank_batch(a, train.batch(step), share, replica_batch, len, owns_first, owns_last);
  }
  /// Mean loss over --eval-batches held-out global batches (Pipeline::evaluate: forward only, eval mode).
  double evaluate(const Args& a, twobp::Pipeline& pipeline, int64_t seq) const {
    double sum = 0.0;
    for (int k = 0; k < a.eval_batches; ++k) {
      const RankBatch b = rank_batch(a, held_out->batch(k), share, replica_batch, seq, owns_first, owns_last);
      sum += pipeline.evaluate(b.inputs, b.targets);
    }
    return sum / a.eval_batches;
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
  const int step = record.step;
  const double remaining = elapsed_s / (step - start + 1) * (end - step - 1);
  fmt::print("step {:>5}/{} | loss {:.4f} | {}{}grad norm {:.3f} | lr {:.2e} | {:.0f} tok/s | peak {} | "
             "{}elapsed {:.1f}s | remaining {:.1f}s\n",
             step + 1, p.args.steps, record.loss, record.skipped ? "update skipped (non-finite) | " : "",
             record.eval_loss
                 ? fmt::format("val loss {:.4f} (ppl {:.2f}) | ", *record.eval_loss, std::exp(*record.eval_loss))
                 : "",
             record.grad_norm, record.lr, record.tokens_per_s,
             record.peak_memory_bytes < 0
                 ? std::string("n/a (rank threads share the GPU)")
                 : fmt::format("{:.1f} MiB{}", record.peak_memory_bytes / (1024.0 * 1024.0),
                               record.memory_limit_held == false
                                   ? fmt::format(" (over the {:.3g} MiB limit)", limit / (1024.0 * 1024.0))
                                   : ""),
             record.j_per_token ? fmt::format("{:.3g} J/tok | ", *record.j_per_token) : "", elapsed_s, remaining);
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
  auto opt = optimizer.state(named);
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
  twobp::Pipeline& pipeline() { return *model.pipeline; }
};

std::unique_ptr<Optimizer> make_optimizer(const Args& a, RankModel& model, twobp::ParallelGroups& groups,
                                          twobp::Duration timeout) {
  // Each tensor once (pipeline.parameters()): with tied embeddings the head chunk lists its table under two names.
  return std::make_unique<Optimizer>(model.pipeline->parameters(),
                                     torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(a.weight_decay),
                                     groups.data_parallel(), a.zero == 1, timeout);
}

/// Which ends of the pipeline this rank feeds under `p`.
void set_ends(const Plan& p, int rank, RankData& data) {
  data.owns_first = p.schedule.stage_to_rank.front() == rank;
  data.owns_last = p.schedule.stage_to_rank.back() == rank;
}

/// Runs `to` from the next step on (collective over the job when the placement changes). The same placement: the
/// schedule and the stages' recomputation switch at the step boundary. Another: the weights and AdamW state are
/// saved by global name (a checkpoint of step `steps_done` in --checkpoint-dir/placement), this rank's chunks of
/// `to` are built with their Pipeline and optimizer, and the state is loaded into them, as --resume does.
void move_to(const Plan& to, RankState& state, twobp::ParallelGroups& groups, c10::Device device, int steps_done,
             twobp::Duration timeout) {
  const int rank = groups.pipeline().rank();
  if (same_placement(state.plan, to)) {
    for (int s : to.schedule.stages_of(rank)) {
      state.pipeline().stage(s).set_recompute(twobp::has_rank(to.recompute_ranks, rank));
    }
    state.pipeline().switch_schedule(to.schedule);
  } else {
    const std::string dir = to.args.checkpoint_dir + "/placement";
    save(state.plan, dir, state.model.named, *state.optimizer, groups, steps_done, timeout);
    state.optimizer.reset();  // the old placement's memory goes before the new one's is allocated
    state.model = RankModel{};
    state.model = build_rank_model(to, groups, device, timeout);
    state.optimizer = make_optimizer(to.args, state.model, groups, timeout);
    auto loaded = ck::load_checkpoint_by_name(dir, to.checkpoint_config, ck::state_of(state.model.named),
                                              fmt::format("rank {} (replica {})", rank, groups.replica()));
    state.optimizer->restore(loaded.tensors, state.model.named);
    set_ends(to, rank, state.data);
    ++state.moves;
  }
  state.plan = to;
}

/// --auto-placements: after twobp::AutoSchedule has chosen among the forms of the starting placement, up to
/// --auto-candidates forms of other placements -- those the LLaMa planner, with costs fitted to the probes
/// (rank_placements), predicts within --auto-within of the best -- run --auto-steps steps each (the first is
/// warm-up), and the job keeps the fastest measured, AutoSchedule's choice included. Measured as AutoSchedule
/// measures (the slowest rank's median pipeline time, over the replicas too), so every rank decides alike.
class PlacementSearch {
 public:
  /// Collective (one message time). Returns the decision; moves `state` to the first trial when there is one.
  std::string start(RankState& state, const twobp::MeasuredCosts& measured, double chosen_ms,
                    twobp::ParallelGroups& groups, c10::Device device, int steps_done, twobp::Duration timeout) {
    const Plan& cur = state.plan;
    const Args& a = cur.args;
    chosen_ = {cur, 0};
    chosen_ms_ = chosen_ms;
    const at::Tensor activation =
        at::zeros({a.micro_batch_size, cur.seq_len, cur.config.dim},
                  at::TensorOptions().dtype(twobp::compute_dtype(cur.precision)).device(device));
    double message_ms = twobp::measure_message_ms(groups.pipeline(), activation, timeout);
    if (groups.data_parallel() != nullptr) {
      message_ms = twobp::max_over_ranks(*groups.data_parallel(), message_ms, timeout);
    }
    const PlacementRanking ranking = rank_placements(cur, measured, message_ms);
    chosen_.predicted_ms = ranking.current_ms;
    const std::string head = fmt::format("auto placement: {} predicted {:.2f} ms/step from costs fitted to the probes "
                                         "({})",
                                         describe_placement(cur), ranking.current_ms, ranking.fit);
    const double best = std::min(ranking.current_ms,
                                 ranking.others.empty() ? ranking.current_ms : ranking.others.front().predicted_ms);
    for (const PlacementCandidate& c : ranking.others) {
      if (static_cast<int>(trials_.size()) == a.auto_candidates || c.predicted_ms > best * (1 + a.auto_within)) break;
      trials_.push_back(c);
    }
    if (trials_.empty()) {
      done_ = true;
      return fmt::format("{}; {}: keeping it", head,
                         ranking.others.empty()
                             ? ranking.why_none
                             : fmt::format("no other placement is predicted faster or within {:.0f} % of it (the "
                                           "fastest, {}, {:.2f})",
                                           100 * a.auto_within, describe_placement(ranking.others.front().plan),
                                           ranking.others.front().predicted_ms));
    }
    std::vector<std::string> listed;
    for (const PlacementCandidate& c : trials_) {
      listed.push_back(fmt::format("{} ({:.2f})", describe_placement(c.plan), c.predicted_ms));
    }
    move_to(trials_.front().plan, state, groups, device, steps_done, timeout);
    return fmt::format("{}; measuring the {} of {} forms of other placements predicted fastest: {}; moving to {}",
                       head, trials_.size(), ranking.others.size(), fmt::join(listed, ", "),
                       describe_placement(trials_.front().plan));
  }

  bool done() const { return done_; }

  /// Call after every step while not done(), on every rank. Collective (a max over the ranks, a move) on the step
  /// that ends a trial; returns the decision then.
  std::optional<std::string> after_step(RankState& state, const twobp::StepResult& result,
                                        twobp::ParallelGroups& groups, c10::Device device, int steps_done,
                                        twobp::Duration timeout) {
    if (++steps_in_trial_ > 1) step_ms_.push_back(result.pipeline_us / 1000.0);  // the first is warm-up
    if (steps_in_trial_ < state.plan.args.auto_steps) return std::nullopt;
    const double mine = twobp::metrics::quantile(step_ms_, 0.5);
    double ms = twobp::max_over_ranks(groups.pipeline(), mine, timeout);
    if (groups.data_parallel() != nullptr) ms = twobp::max_over_ranks(*groups.data_parallel(), ms, timeout);
    const PlacementCandidate& tried = trials_[trial_ms_.size()];
    trial_ms_.push_back(ms);
    steps_in_trial_ = 0;
    step_ms_.clear();
    const std::string measured = fmt::format("auto placement: {} measured {:.2f} ms/step (predicted {:.2f})",
                                             describe_placement(tried.plan), ms, tried.predicted_ms);
    if (trial_ms_.size() < trials_.size()) {
      const Plan& next = trials_[trial_ms_.size()].plan;
      const char* verb = same_placement(state.plan, next) ? "switching to" : "moving to";
      move_to(next, state, groups, device, steps_done, timeout);
      return fmt::format("{}; {} {}", measured, verb, describe_placement(next));
    }
    // The fastest measured; ties keep AutoSchedule's choice, then the first tried.
    const PlacementCandidate* best = &chosen_;
    double best_ms = chosen_ms_;
    for (std::size_t k = 0; k < trials_.size(); ++k) {
      if (trial_ms_[k] < best_ms) {
        best = &trials_[k];
        best_ms = trial_ms_[k];
      }
    }
    done_ = true;
    const bool running = best == &trials_.back();
    const char* verb = running ? "keeping" : same_placement(state.plan, best->plan) ? "switching to" : "moving to";
    if (!running) move_to(best->plan, state, groups, device, steps_done, timeout);
    if (best == &chosen_) {
      return fmt::format("{}; back to {}: {:.2f} ms/step, the fastest of {} measured", measured,
                         describe_placement(best->plan), best_ms, trials_.size() + 1);
    }
    return fmt::format("{}; {} {}: {:.2f} ms/step measured against {:.2f} for {} ({:.2f}x), the fastest of {} "
                       "measured",
                       measured, verb, describe_placement(best->plan), best_ms,
                       chosen_ms_, describe_placement(chosen_.plan), chosen_ms_ / best_ms, trials_.size() + 1);
  }

 private:
  PlacementCandidate chosen_;  // AutoSchedule's choice in the starting placement
  double chosen_ms_ = 0;
  std::vector<PlacementCandidate> trials_;
  std::vector<double> trial_ms_;
  int steps_in_trial_ = 0;
  std::vector<double> step_ms_;
  bool done_ = false;
};

/// --costs-json: the run's per-stage costs, agreed over the pipeline's ranks and the replicas, and the time of one
/// activation message, as a `twobp_bench pipeline --json` document -- the model's sizes in "config", a "2bp" result
/// (F, I, W) and a "standard" one (F, B) where the run measured those on every stage (a stage without them would
/// read as free to the fit) -- from which `twobp_bench plan --costs-json` fits per-chunk costs and plans any
/// placement. Collective over the pipeline (and the replicas); world rank 0 writes.
void write_costs(const Plan& p, twobp::ParallelGroups& groups, const twobp::CostRecorder& recorder,
                 const std::string& schedule, c10::Device device, bool writes, twobp::Duration timeout) {
  twobp::Transport& transport = groups.pipeline();
  twobp::MeasuredCosts costs =
      twobp::agree_costs(transport, recorder.local_medians(), timeout, groups.data_parallel());
  const llm::LlamaConfig& c = p.config;
  const at::Tensor activation =
      at::empty({p.args.micro_batch_size, p.seq_len, c.dim},
                at::TensorOptions().dtype(twobp::compute_dtype(p.precision)).device(device));
  costs.communication = twobp::measure_message_ms(transport, activation, timeout);
  if (!writes) return;
  nlohmann::json doc;
  doc["config"] = {{"model", "llama"}, {"source", "llama_pipeline --costs-json"}, {"dim", c.dim},
                   {"layers", c.n_layers}, {"heads", c.n_heads}, {"kv_heads", c.n_kv_heads}, {"ffn", c.ffn_dim},
                   {"vocab", c.vocab_size}, {"seq", p.seq_len}, {"micro_batch_size", p.args.micro_batch_size},
                   {"dtype", p.args.dtype}, {"device", device.str()}, {"steps_measured", recorder.steps()}};
  doc["results"] = nlohmann::json::array();
  const nlohmann::json measured = nlohmann::json::parse(twobp::measured_costs_json(costs));
  auto result = [&](const char* mode) {
    nlohmann::json r = measured;
    r["schedule"] = schedule;
    r["mode"] = mode;
    r["p"] = p.world_size;
    r["v"] = p.schedule.num_stages / p.world_size;
    r["m"] = p.args.microbatches;
    r["partition"] = p.partition.layout();
    r["replicas"] = p.dp;
    return r;
  };
  auto every_stage = [](const std::vector<double>& ms) {
    return !ms.empty() && std::all_of(ms.begin(), ms.end(), [](double x) { return x > 0; });
  };
  if (every_stage(costs.backward_input) && every_stage(costs.backward_weight)) {
    doc["results"].push_back(result(twobp::to_string(twobp::BackwardMode::kSplit)));
  }
  if (every_stage(costs.backward)) {  // fused B's on every stage: the F and B of a standard result
    nlohmann::json r = result(twobp::to_string(twobp::BackwardMode::kStandard));
    const std::vector<double> zeros(costs.forward.size(), 0.0);
    r["costs_ms"]["I"] = zeros;
    r["costs_ms"]["W"] = zeros;
    r["costs_ms"].erase("W0");
    doc["results"].push_back(std::move(r));
  }
  write_json(p.args.costs_json, doc);
}

}  // namespace

void train_rank(const Plan& p, twobp::Transport& world, c10::Device device, const std::vector<uint16_t>& tokens,
                const std::vector<uint16_t>& held_out, Shared& shared) {
  const Args& a = p.args;
  const auto timeout = twobp::Duration(static_cast<int64_t>(a.timeout_s * 1000));
  // The pipeline of this rank's replica, and the group of the same stages in every replica (dp > 1).
  twobp::ParallelGroups groups(world, p.dp, timeout);
  twobp::Transport& transport = groups.pipeline();
  const int rank = transport.rank();  // in the pipeline
  const bool reports = world.rank() == 0;
  // One global batch per step, the same for every --dp; replica d trains on its d-th share.
  const int64_t replica_batch = a.microbatches * a.micro_batch_size, global_batch = p.dp * replica_batch;
  RankState state{p, build_rank_model(p, groups, device, timeout), nullptr,
                  RankData{twobp::data::BatchSampler(tokens, p.seq_len, global_batch, a.seed), std::nullopt,
                           replica_batch, groups.replica() * replica_batch}};
  state.optimizer = make_optimizer(a, state.model, groups, timeout);
  set_ends(p, rank, state.data);
  if (a.eval_every > 0) state.data.held_out.emplace(held_out, p.seq_len, global_batch, a.seed);
  int start = 0;
  if (a.resume) {
    // By global name: the parameters of this rank's chunks, wherever the checkpoint's layout had them.
    auto loaded = ck::load_checkpoint_by_name(a.checkpoint_dir, p.checkpoint_config,
                                              ck::state_of(state.model.named),
                                              fmt::format("rank {} (replica {})", rank, groups.replica()));
    state.optimizer->restore(loaded.tensors, state.model.named);
    start = static_cast<int>(loaded.step);
    if (reports) {
      shared.resumed_from = start;
      fmt::print("resuming from step {} of {} ({})\n", start, a.steps, a.checkpoint_dir);
    }
  }
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

  const int end = a.stop_after > 0 ? std::min(a.stop_after, a.steps) : a.steps;
  // --schedule auto: measure the starting schedule, switch to the predicted fastest, keep it if it measures faster.
  std::optional<twobp::AutoSchedule> chooser;
  if (a.auto_schedule()) {
    twobp::AutoScheduleOptions o;
    o.probe_steps = o.verify_steps = a.auto_steps;
    o.measure_candidates = a.auto_candidates;
    o.measure_within = a.auto_within;
    // Needs the per-action memory readings, which rank threads sharing a GPU do not take (build_rank_model).
    TWOBP_CHECK(a.auto_memory_limit_gb <= 0 || state.pipeline().options().executor.record_memory, twobp::UsageError,
                "--auto-memory-limit-gb: rank {}'s memory is not measured per action (rank threads sharing {}, whose "
                "memory statistics are the whole process's); run one rank per GPU",
                rank, device.str());
    o.memory_limit_bytes = a.auto_memory_limit_gb * 1024.0 * 1024.0 * 1024.0;
    o.recompute = a.auto_recompute;
    o.probe_weight_sizes = a.auto_weight_sizes;
    o.replicas = groups.data_parallel();
    o.timeout = timeout;
    chooser.emplace(state.pipeline(), o);
  }
  std::optional<PlacementSearch> placements;  // --auto-placements, once the chooser is done
  std::vector<twobp::StepAttribution> attributions;
  // --costs-json: every full-length step's actions after the run's first step (warm-up).
  std::optional<twobp::CostRecorder> costs;
  if (!a.costs_json.empty()) {
    TWOBP_CHECK(end - start >= 2, twobp::UsageError,
                "--costs-json measures the steps after this run's first (warm-up); this run has {} step(s): give "
                "--steps (and --stop-after) for at least 2",
                end - start);
    costs.emplace(p.schedule.num_stages);
  }
  int costs_from = start + 1;  // the first step the recorder takes (after a move: the new placement's second)
  int costs_moves = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = start; step < end; ++step) {
    twobp::Pipeline& pipeline = state.pipeline();  // this step's (a move between steps builds another)
    RankData& data = state.data;
    const auto ts = std::chrono::steady_clock::now();
    const std::optional<double> e0 = rank_energy.share();
    const double lr = learning_rate(a, step);
    state.optimizer->set_lr(lr);
    pipeline.zero_grad();
    // The step's sequence length (shorter during --seq-len-warmup): a prefix of the full-length windows, so the
    // batch of a step still depends only on (--seed, step).
    const int64_t len = twobp::data::warmup_seq_len(p.seq_len, step, a.seq_len_warmup);
    const RankBatch batch = data.batch(a, step, len);
    const auto step_start = std::chrono::steady_clock::now();
    const twobp::StepResult result = pipeline.step(batch.inputs, batch.targets);
    const auto step_end = std::chrono::steady_clock::now();
    if (costs && step >= costs_from && len == p.seq_len) costs->add(result.trace);
    // The gate: no optimizer step on a NaN or Inf loss or gradient (--on-nonfinite stop: NumericalError naming the
    // step and stages; skip: this step's update is dropped on every rank), gradients clipped to --clip (0: not).
    const bool updated = pipeline.ready_for_optimizer(
        step + 1, a.on_nonfinite == "skip" ? twobp::NonFinitePolicy::kSkipStep : twobp::NonFinitePolicy::kStop,
        a.clip);
    if (updated) state.optimizer->step();
    if (step > start || end - start == 1) {
      // The step from the pipeline's start to the optimizer's end (gradient gate, clipping and update included).
      const auto optimizer_end = std::chrono::steady_clock::now();
      twobp::StepTimes times;
      times.pipeline_us = result.pipeline_us;
      times.reduce_wait_us = result.reduce_wait_us;
      times.optimizer_us = std::chrono::duration<double, std::micro>(optimizer_end - step_end).count();
      times.step_us = std::chrono::duration<double, std::micro>(optimizer_end - step_start).count();
      attributions.push_back(twobp::attribute_step(pipeline.schedule(), result.trace, times));
    }
    // After the step's own accounting (which reads the schedule it ran), before the next step: a switch lands on
    // the step boundary. Collective on the steps where it decides.
    // The record first: a move to another placement below replaces the pipeline.
    StepRecord record{step, pipeline.mean_loss(result), 0, pipeline.last_gradient_check().norm, lr, 0};
    auto decided = [&](const std::string& news) {
      if (!reports) return;
      fmt::print("{}\n", news);
      std::lock_guard<std::mutex> lock(shared.mutex);
      shared.auto_decisions.emplace_back(step, news);
      if (chooser) shared.auto_ranking = chooser->ranking();
    };
    if (chooser) {
      if (std::optional<std::string> news = chooser->after_step(result)) {
        decided(*news);
        state.plan.schedule = pipeline.schedule();
        const std::vector<int>& chosen = chooser->recompute_ranks();  // empty: as built
        state.plan.recompute_ranks = chosen.empty() ? p.recompute_ranks : chosen;
      }
      if (chooser->phase() == twobp::AutoSchedule::Phase::kDone && a.auto_placements && !placements) {
        const twobp::MeasuredCosts measured = chooser->measured_costs();
        const double chosen_ms = chooser->chosen_ms();
        chooser.reset();  // it holds the pipeline, which a move replaces
        placements.emplace();
        decided(placements->start(state, measured, chosen_ms, groups, device, step + 1, timeout));
      }
    } else if (placements && !placements->done()) {
      if (auto news = placements->after_step(state, result, groups, device, step + 1, timeout)) decided(*news);
    }
    if (costs && state.moves != costs_moves) {  // moved: the new placement's stages from its second step
      costs.emplace(state.plan.schedule.num_stages);
      costs_moves = state.moves;
      costs_from = step + 2;
    }
    record.skipped = !updated;
    // SIGINT/SIGTERM (collective over the world): every rank makes this step its last -- evaluation, trace and
    // checkpoint as at the end -- so that the outputs of the steps done are written.
    const bool interrupted = shared.interrupts != nullptr && shared.interrupts->agreed(world, timeout);
    const bool last = step + 1 == end || interrupted;
    // Held-out loss of the updated weights.
    if (data.held_out && ((step + 1) % a.eval_every == 0 || last)) {
      record.eval_loss = data.evaluate(a, state.pipeline(), p.seq_len);
    }
    const std::optional<double> e1 = rank_energy.share();
    const auto now = std::chrono::steady_clock::now();
    report_step(p, world, transport, record, result, std::chrono::duration<double>(now - ts).count(),
                std::chrono::duration<double>(now - t0).count(), start, end,
                e0 && e1 ? std::optional<double>(*e1 - *e0) : std::nullopt, static_cast<double>(global_batch * len),
                timeout, shared);
    if (!a.trace.empty() && last) {
      // Every rank's trace on every rank (collective), so rank 0 writes them all, threads or processes.
      std::vector<twobp::Trace> traces = twobp::gather_traces(world, result.trace, timeout);
      if (reports) {
        std::lock_guard<std::mutex> lock(shared.mutex);
        shared.traces = std::move(traces);
      }
    }
    const bool periodic = a.checkpoint_every > 0 && (step + 1) % a.checkpoint_every == 0;
    if (!a.checkpoint_dir.empty() && (periodic || last)) {
      save(state.plan, a.checkpoint_dir, state.model.named, *state.optimizer, groups, step + 1, timeout);
      if (reports) fmt::print("checkpoint of step {} written to {}\n", step + 1, a.checkpoint_dir);
    }
    if (interrupted) break;
  }
  // Interrupted before a full-length step after the first was measured: no costs to write (said by main()).
  if (costs && !(costs->steps() == 0 && shared.interrupts != nullptr && shared.interrupts->received() != 0)) {
    TWOBP_CHECK(costs->steps() > 0, twobp::UsageError,
                "--costs-json: no full-length step after the first was measured (--seq-len-warmup {} covers the "
                "run's steps); run more steps",
                a.seq_len_warmup);
    write_costs(state.plan, groups, *costs, state.pipeline().schedule().name, device, reports, timeout);
  }
  if (reports) {
    std::lock_guard<std::mutex> lock(shared.mutex);
    const twobp::Schedule& final_schedule = state.pipeline().schedule();
    shared.final_schedule = final_schedule.name;
    shared.final_two_bp = final_schedule.backward == twobp::BackwardMode::kSplit;
    shared.final_recompute_ranks = state.plan.recompute_ranks;
    shared.final_chunks_per_rank = final_schedule.num_stages / final_schedule.num_ranks;
    shared.final_partition = state.plan.partition.layout();
  }
  if (!attributions.empty()) {  // every rank ran the same steps: all of a pipeline call this, or none
    auto ranks = twobp::gather_attributions(transport, twobp::mean_attribution(attributions), timeout);
    if (reports) {
      std::lock_guard<std::mutex> lock(shared.mutex);
      shared.attribution = std::move(ranks);
    }
  }
  // The optimizer state each rank holds (with --zero 1, its share), every world rank's in its slot.
  std::vector<double> state_bytes =
      twobp::gather_over_ranks(world, static_cast<double>(state.optimizer->state_bytes()), timeout);
  if (reports) {
    std::lock_guard<std::mutex> lock(shared.mutex);
    shared.optimizer_state_bytes = std::move(state_bytes);
  }
}

void print_summary(const std::vector<StepRecord>& records, const std::vector<twobp::StepAttribution>& attribution,
                   double wall_s, const std::vector<std::string>& written) {
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
  const auto limited = std::count_if(records.begin(), records.end(), [](const StepRecord& r) {
    return r.memory_limit_held.has_value();
  });
  if (limited > 0) {
    const auto held = std::count_if(records.begin(), records.end(), [](const StepRecord& r) {
      return r.memory_limit_held.value_or(false);
    });
    fmt::print("memory limit held on {} of {} steps\n", held, limited);
  }
  if (!attribution.empty()) {
    fmt::print("where each rank's step went (mean over {} steps; replica 0):\n",
               records.size() > 1 ? records.size() - 1 : records.size());
    for (const twobp::StepAttribution& a : attribution) fmt::print("  {}\n", twobp::format_attribution(a));
  }
  if (!written.empty()) fmt::print("files written: {}\n", fmt::join(written, ", "));
}

}  // namespace llama_example
