// `zero`: what each ZeRO stage keeps and sends per rank, measured. dp replicas of a small LLaMa pipeline
// (models::build_llama_rank) as rank threads on the CPU train a few AdamW steps at ZeRO 0, 1 and 2, and each rank
// reports twobp::replica_memory: its parameters, gradient peak, masters, optimizer state and the bytes its
// data-parallel collectives sent in the last step. The summary gives, per rank, (gradient peak + masters +
// optimizer state) and the bytes sent of ZeRO 2 as ratios of ZeRO 0's and ZeRO 1's. Byte counts only: no timing.

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "twobp/models/llama_rank.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::bench {
namespace {
namespace zero_bench {

struct Args {
  int dp = 2, pp = 2, micro_batches = 4, steps = 2;
  int64_t dim = 64, layers = 4, heads = 4, ffn = 172, vocab = 256, seq = 32, micro_batch_size = 2;
  int64_t bucket_kb = 16;
  std::string schedule = "gpipe", mode = "2bp", precision = "fp32", json;  // gpipe 2BP: W once per step
};

struct Row {
  ZeroStage zero = ZeroStage::k0;
  int world_rank = 0, replica = 0, pipeline_rank = 0;
  ReplicaMemory m;
  int64_t sharded() const { return m.gradient_peak + m.masters + m.optimizer_state; }
};

// One job at `zero`: every world rank's replica_memory after the last step.
std::vector<Row> run_job(const Args& a, ZeroStage zero) {
  models::LlamaConfig config;
  config.name = "zero-bench";
  config.dim = a.dim;
  config.n_layers = a.layers;
  config.n_heads = config.n_kv_heads = a.heads;
  config.ffn_dim = a.ffn;
  config.vocab_size = a.vocab;
  config.max_seq_len = a.seq;
  const BackwardMode mode = a.mode == "2bp" ? BackwardMode::kSplit : BackwardMode::kStandard;
  const Schedule schedule =
      make_schedule(a.schedule, default_schedule_options(a.schedule, a.pp, a.micro_batches, mode));
  const models::Partition partition = models::make_partition(config, schedule.num_stages, a.seq);
  torch::manual_seed(0);
  const int64_t rows = a.micro_batches * a.micro_batch_size;
  const at::Tensor tokens = torch::randint(a.vocab, {a.dp * rows, a.seq + 1}, at::kLong);
  const at::Tensor inputs = tokens.narrow(1, 0, a.seq), targets = tokens.narrow(1, 1, a.seq);
  const Duration timeout = std::chrono::seconds(120);
  std::vector<Row> out(a.dp * a.pp);
  auto world = make_local_transports(a.dp * a.pp);
  run_rank_threads(world, [&](Transport& t) {
    ParallelGroups groups(t, a.dp, timeout);
    models::LlamaRankOptions o{config, partition, /*seed=*/1};
    o.micro_batch_size = a.micro_batch_size;
    o.seq_len = a.seq;
    o.precision = parse_precision(a.precision);
    PipelineOptions po;
    po.executor.timeout = timeout;
    po.data_parallel.group = groups.data_parallel();
    po.data_parallel.zero = zero;
    po.data_parallel.bucket_bytes = po.data_parallel.first_bucket_bytes = a.bucket_kb << 10;
    models::LlamaRank rank = models::build_llama_rank(schedule, groups.pipeline(), o, po);
    Pipeline& p = *rank.pipeline;
    auto make = [](std::vector<at::Tensor> ps) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::AdamW>(std::move(ps), torch::optim::AdamWOptions(1e-3));
    };
    // ZeRO 0: one optimizer over this rank's parameters (no group); 1 and 2: sharded over the replicas.
    auto optimizer = zero == ZeroStage::k0 ? std::make_unique<ShardedOptimizer>(p.parameters(), nullptr, make, timeout)
                                           : std::make_unique<ShardedOptimizer>(p, make);
    const int pr = groups.pipeline_rank();
    const auto batch = models::llama_rank_batch(inputs, targets, groups.replica() * rows, rows, a.seq,
                                                schedule.stage_to_rank[0] == pr,
                                                schedule.stage_to_rank[schedule.num_stages - 1] == pr, false, 0);
    for (int step = 0; step < a.steps; ++step) {
      p.zero_grad();
      p.step(batch.inputs, batch.targets);
      if (p.ready_for_optimizer(step, NonFinitePolicy::kStop, 1.0)) optimizer->step();
    }
    out[t.rank()] = Row{zero, t.rank(), groups.replica(), pr, replica_memory(p, *optimizer)};
  }).rethrow_root_cause();
  return out;
}

std::vector<Column<Row>> columns() {
  auto mib = [](int64_t b) { return fmt_num(static_cast<double>(b) / (1 << 20), 3); };
  return {
      column<Row>("zero", [](const Row& r) { return Json(to_string(r.zero)); }, "zero",
                  [](const Row& r) { return std::string(to_string(r.zero)); }),
      column<Row>("world_rank", [](const Row& r) { return Json(r.world_rank); }, "rank",
                  [](const Row& r) { return std::to_string(r.world_rank); }),
      column<Row>("replica", [](const Row& r) { return Json(r.replica); }),
      column<Row>("pipeline_rank", [](const Row& r) { return Json(r.pipeline_rank); }),
      column<Row>("parameter_bytes", [](const Row& r) { return Json(r.m.parameters); }, "params MiB",
                  [mib](const Row& r) { return mib(r.m.parameters); }),
      column<Row>("gradient_peak_bytes", [](const Row& r) { return Json(r.m.gradient_peak); }, "grad peak MiB",
                  [mib](const Row& r) { return mib(r.m.gradient_peak); }),
      column<Row>("master_bytes", [](const Row& r) { return Json(r.m.masters); }, "masters MiB",
                  [mib](const Row& r) { return mib(r.m.masters); }),
      column<Row>("optimizer_state_bytes", [](const Row& r) { return Json(r.m.optimizer_state); }, "optim MiB",
                  [mib](const Row& r) { return mib(r.m.optimizer_state); }),
      column<Row>("sharded_bytes", [](const Row& r) { return Json(r.sharded()); }, "grad+masters+optim MiB",
                  [mib](const Row& r) { return mib(r.sharded()); }),
      column<Row>("dp_bytes_sent", [](const Row& r) { return Json(r.m.bytes_sent); }, "dp MiB sent/step",
                  [mib](const Row& r) { return mib(r.m.bytes_sent); }),
  };
}

void run(const Args& a) {
  std::vector<std::vector<Row>> by_stage;
  for (ZeroStage z : {ZeroStage::k0, ZeroStage::k1, ZeroStage::k2}) by_stage.push_back(run_job(a, z));
  // Per rank, ZeRO 2 against 0 (memory) and against 1 (traffic); the summary is the worst rank's.
  double memory_ratio = 0, traffic_ratio = 0;
  for (std::size_t w = 0; w < by_stage[0].size(); ++w) {
    memory_ratio = std::max(memory_ratio, static_cast<double>(by_stage[2][w].sharded()) / by_stage[0][w].sharded());
    traffic_ratio = std::max(traffic_ratio, static_cast<double>(by_stage[2][w].m.bytes_sent) /
                                                std::max<int64_t>(1, by_stage[1][w].m.bytes_sent));
  }
  const Reporter<Row> reporter(columns(), {"zero", "rank", "params MiB", "grad peak MiB", "masters MiB", "optim MiB",
                                           "grad+masters+optim MiB", "dp MiB sent/step"});
  std::vector<Row> rows;
  for (const auto& stage : by_stage) rows.insert(rows.end(), stage.begin(), stage.end());
  print_table(std::cout, reporter.table(rows));
  std::cout << "zero 2 / zero 0, gradient peak + masters + optimizer state (worst rank): " << fmt_num(memory_ratio, 3)
            << "\nzero 2 / zero 1, data-parallel bytes sent per step (worst rank): " << fmt_num(traffic_ratio, 3)
            << "\n";
  if (a.json.empty()) return;
  Json doc;
  doc["config"] = {{"dp", a.dp}, {"pp", a.pp}, {"schedule", a.schedule}, {"mode", a.mode},
                   {"micro_batches", a.micro_batches}, {"steps", a.steps}, {"dim", a.dim}, {"layers", a.layers},
                   {"precision", a.precision}, {"bucket_kb", a.bucket_kb}};
  doc["results"] = Json::array();
  for (const Row& r : rows) doc["results"].push_back(reporter.json(r));
  doc["ratios"] = {{"zero2_over_zero0_sharded_bytes", memory_ratio}, {"zero2_over_zero1_dp_bytes_sent", traffic_ratio}};
  cli::write_json(a.json, doc);
  std::cout << "wrote " << a.json << "\n";
}

}  // namespace zero_bench
}  // namespace

void add_zero_command(CLI::App& app) {
  auto a = std::make_shared<zero_bench::Args>();
  CLI::App* sub = app.add_subcommand(
      "zero", "Per-rank memory (gradient peak, masters, optimizer state) and data-parallel bytes of ZeRO 0, 1, 2");
  count_option(sub, "--dp", a->dp, "Data-parallel replicas (rank threads: dp x pp)", 2, 16);
  count_option(sub, "--pp", a->pp, "Pipeline ranks per replica", 1, 16);
  sub->add_option("--schedule", a->schedule, "Schedule")->capture_default_str()->check(
      CLI::IsMember(builtin_schedule_names()));
  sub->add_option("--mode", a->mode, "standard or 2bp")->capture_default_str()->check(
      CLI::IsMember({"standard", "2bp"}));
  sub->add_option("--precision", a->precision,
                  "fp32, bf16 (mixed: float32 masters) or bf16-pure (twobp::parse_precision)")
      ->capture_default_str();
  count_option(sub, "--microbatches", a->micro_batches, "Micro-batches per replica and step");
  count_option(sub, "--steps", a->steps, "Training steps (the last one is reported)");
  count_option(sub, "--dim", a->dim, "Model width");
  count_option(sub, "--layers", a->layers, "Transformer layers");
  count_option(sub, "--heads", a->heads, "Attention heads");
  count_option(sub, "--ffn", a->ffn, "MLP hidden size");
  count_option(sub, "--seq", a->seq, "Tokens per sequence");
  count_option(sub, "--bucket-kb", a->bucket_kb, "Data-parallel bucket size, KiB (smaller: a lower ZeRO-2 peak)");
  sub->add_option("--json", a->json, "Write {\"config\", \"results\": [...], \"ratios\"} here")
      ->check(cli::writable_file());
  sub->callback([a] { zero_bench::run(*a); });
}

}  // namespace twobp::bench
