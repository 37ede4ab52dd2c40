// The twobp side of tests/models/hf_compare.py: imports a transformers Llama checkpoint into twobp chunks and
// reports what they compute, or exports the imported weights back to transformers' format.
//
//   hf_probe forward HF_DIR CHUNKS BATCH OUT   import HF_DIR into CHUNKS float64 chunks (a balanced partition),
//                                             run BATCH's "input_ids" through them, the loss against its
//                                             "targets" (mean cross entropy in float64), backward; write "logits",
//                                             "loss", "inv_freq" (the rotary frequencies) and "grad.<transformers
//                                             name>" of every parameter to the safetensors file OUT
//   hf_probe export HF_DIR CHUNKS OUT_DIR DTYPE [MAX_SHARD_BYTES]
//                                             import HF_DIR into CHUNKS float32 chunks (float64 for f64), gather
//                                             their tensors and export them as DTYPE (f32, bf16, f64) to OUT_DIR
//   hf_probe pipeline HF_DIR RANKS DP SCHEDULE MODE BATCH OUT [STEPS EXPORT_DIR]
//                                             import HF_DIR into a pipeline of RANKS rank threads x DP replicas
//                                             (models::build_llama_rank, float64, SCHEDULE with MODE 2bp or
//                                             standard, one sequence per micro-batch, the token-mean loss), one
//                                             step on BATCH: write "loss" and "grad.<transformers name>" (replica
//                                             0's; a tied head's copy is the embedding's) to OUT. With STEPS > 0,
//                                             train STEPS clipped AdamW steps, export the weights (gathered from the
//                                             ranks, float32) to EXPORT_DIR and add "trained_logits" (float64, the
//                                             trained weights as one chunk) to OUT
// Exit status 0 on success; 3 with the message on stderr when twobp refuses (a twobp::Error), 2 on bad usage.

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"
#include "twobp/models/hf_llama.h"
#include "twobp/models/llama.h"
#include "twobp/models/llama_rank.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/training_state.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace {

namespace ck = twobp::checkpoint;
namespace llm = twobp::models;

std::vector<llm::LlamaChunk> import_chunks(const std::string& dir, int chunks, int64_t seq, at::ScalarType dtype) {
  const llm::LlamaConfig config = llm::read_hf_llama_config(dir);
  const llm::Partition partition = llm::make_partition(config, chunks, seq);
  std::printf("hf_probe: %s, %d chunk(s), layout %s\n", config.name.c_str(), chunks, partition.layout().c_str());
  std::vector<llm::LlamaChunk> out;
  for (const llm::ChunkSpec& spec : partition.chunks) {
    llm::LlamaChunk chunk(config, spec, /*seed=*/0);
    chunk->to(dtype);
    llm::load_hf_llama(dir, *chunk);  // only this chunk's tensors
    out.push_back(chunk);
  }
  return out;
}

int forward(const std::string& dir, int chunks, const std::string& batch_path, const std::string& out_path) {
  const ck::SafetensorsFile batch(batch_path);
  const at::Tensor ids = batch.read("input_ids"), targets = batch.read("targets");
  std::vector<llm::LlamaChunk> model = import_chunks(dir, chunks, ids.size(1), at::kDouble);
  at::Tensor h = ids;
  for (auto& chunk : model) h = chunk->forward(h);
  const at::Tensor logits = h;
  // The loss in float64 (models::cross_entropy_loss computes in float32, as training wants).
  const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  loss.backward();
  ck::NamedTensors out = {{"logits", logits.detach()},
                          {"loss", loss.detach()},
                          {"inv_freq", llm::rope_inverse_frequencies(model.front()->config())}};
  for (auto& chunk : model) {
    for (const auto& [name, p] : ck::module_tensors(*chunk)) {
      out.emplace_back("grad." + llm::hf_llama_name(name), p.grad());
    }
  }
  ck::write_safetensors(out_path, out, {}, /*durable=*/false);
  return 0;
}

struct PipelineRun {
  std::string dir, schedule, mode, batch, out, export_dir;
  int ranks = 1, dp = 1, steps = 0;
};

std::string read_text(const std::string& path) {
  std::string text;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  for (int c; f != nullptr && (c = std::fgetc(f)) != EOF;) text.push_back(static_cast<char>(c));
  if (f != nullptr) std::fclose(f);
  return text;
}

// The trained weights (every rank's, by twobp name) as one float64 chunk: its logits for `ids`.
at::Tensor logits_of(const llm::LlamaConfig& config, const std::map<std::string, at::Tensor>& weights,
                     const at::Tensor& ids) {
  llm::ChunkSpec whole{0, static_cast<int>(config.n_layers), true, true};
  llm::LlamaChunk model(config, whole, /*seed=*/0);
  model->to(at::kDouble);
  c10::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) item.value().copy_(weights.at(item.key()));
  return model->forward(ids);
}

// One rank thread of `pipeline`: builds its rank, imports, steps; replica 0 records into `out` / `weights`.
void pipeline_rank(twobp::Transport& world, const PipelineRun& r, const twobp::Schedule& schedule,
                   const llm::LlamaRankOptions& o, const at::Tensor& ids, const at::Tensor& targets,
                   ck::NamedTensors& out, std::map<std::string, at::Tensor>& weights, std::mutex& mutex) {
  twobp::ParallelGroups groups(world, r.dp, std::chrono::seconds(60));
  twobp::PipelineOptions base;
  base.executor.timeout = std::chrono::seconds(60);
  base.data_parallel.group = groups.data_parallel();
  llm::LlamaRank rank = llm::build_llama_rank(schedule, groups.pipeline(), o, base);
  llm::load_hf_llama(r.dir, o.config, rank.named);
  const int p = groups.pipeline_rank();
  const int64_t share = ids.size(0) / r.dp;
  const llm::LlamaRankBatch batch =
      llm::llama_rank_batch(ids, targets, groups.replica() * share, share, ids.size(1),
                            schedule.stage_to_rank.front() == p, schedule.stage_to_rank.back() == p, false, 0);
  torch::optim::AdamW adam(rank.pipeline->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < std::max(1, r.steps); ++step) {
    rank.pipeline->zero_grad();
    const double loss = rank.pipeline->mean_loss(rank.pipeline->step(batch.inputs, batch.targets));
    if (step == 0 && groups.replica() == 0) {
      std::lock_guard<std::mutex> lock(mutex);
      if (p == 0) out.emplace_back("loss", at::full({}, loss, at::kDouble));
      for (const auto& [name, t] : rank.named) {
        if (o.config.tie_embeddings && name == "head.weight") continue;  // the embedding's copy: the same gradient
        out.emplace_back("grad." + llm::hf_llama_name(name), t.grad().clone());
      }
    }
    if (r.steps == 0) break;
    if (rank.pipeline->ready_for_optimizer(step, twobp::NonFinitePolicy::kStop, 1.0)) adam.step();
  }
  if (groups.replica() == 0) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [name, t] : rank.named) weights[name] = t.detach().clone();
  }
}

int pipeline(const PipelineRun& r) {
  const ck::SafetensorsFile batch(r.batch);
  const at::Tensor ids = batch.read("input_ids"), targets = batch.read("targets");
  const llm::LlamaConfig config = llm::read_hf_llama_config(r.dir);
  const int m = static_cast<int>(ids.size(0)) / r.dp;
  const twobp::Schedule schedule = twobp::make_schedule(
      r.schedule,
      twobp::default_schedule_options(r.schedule, r.ranks, m, twobp::parse_backward_mode(r.mode)));
  llm::LlamaRankOptions o{config, llm::make_partition(config, schedule.num_stages, ids.size(1)), 0, 1, ids.size(1)};
  o.precision = twobp::Precision::kFloat64;
  std::printf("hf_probe: %s, %s %s, %d rank(s) x dp %d, layout %s\n", config.name.c_str(), r.schedule.c_str(),
              r.mode.c_str(), r.ranks, r.dp, o.partition.layout().c_str());
  ck::NamedTensors out;
  std::map<std::string, at::Tensor> weights;
  std::mutex mutex;
  auto transports = twobp::make_local_transports(r.ranks * r.dp);
  twobp::run_rank_threads(transports, [&](twobp::Transport& world) {
    pipeline_rank(world, r, schedule, o, ids, targets, out, weights, mutex);
  }).rethrow_root_cause();
  if (r.steps > 0) {
    ck::NamedTensors gathered(weights.begin(), weights.end());
    llm::HfExportOptions e;
    e.dtype = at::kFloat;
    e.base_config = read_text(r.dir + "/config.json");
    e.durable = false;
    for (const std::string& file : llm::export_hf_llama(r.export_dir, config, gathered, e)) {
      std::printf("hf_probe: wrote %s/%s\n", r.export_dir.c_str(), file.c_str());
    }
    out.emplace_back("trained_logits", logits_of(config, weights, ids).detach());
  }
  ck::write_safetensors(r.out, out, {}, /*durable=*/false);
  return 0;
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "f32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  if (name == "f64") return at::kDouble;
  throw twobp::UsageError("hf_probe: dtype must be f32, bf16 or f64, got '" + name + "'");
}

int export_dir(const std::string& dir, int chunks, const std::string& out_dir, const std::string& dtype,
               uint64_t max_shard_bytes) {
  // float32 chunks, as training keeps its masters (float64 ones for a float64 export: bitwise the file's values).
  const at::ScalarType target = parse_dtype(dtype);
  std::vector<llm::LlamaChunk> model = import_chunks(dir, chunks, 8, target == at::kDouble ? at::kDouble : at::kFloat);
  ck::NamedTensors all;  // every chunk's tensors: what a pipeline's ranks would gather
  for (auto& chunk : model) {
    for (const auto& entry : ck::module_tensors(*chunk)) all.push_back(entry);
  }
  std::FILE* f = std::fopen((dir + "/config.json").c_str(), "rb");
  std::string base;
  for (int c; f != nullptr && (c = std::fgetc(f)) != EOF;) base.push_back(static_cast<char>(c));
  if (f != nullptr) std::fclose(f);
  llm::HfExportOptions o;
  o.dtype = target;
  o.max_shard_bytes = max_shard_bytes;
  o.base_config = base;
  o.durable = false;
  for (const std::string& file : llm::export_hf_llama(out_dir, model.front()->config(), all, o)) {
    std::printf("hf_probe: wrote %s/%s\n", out_dir.c_str(), file.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() == 5 && a[0] == "forward") return forward(a[1], std::stoi(a[2]), a[3], a[4]);
    if ((a.size() == 8 || a.size() == 10) && a[0] == "pipeline") {
      PipelineRun r{a[1], a[4], a[5], a[6], a[7], a.size() == 10 ? a[9] : "", std::stoi(a[2]), std::stoi(a[3]),
                    a.size() == 10 ? std::stoi(a[8]) : 0};
      return pipeline(r);
    }
    if ((a.size() == 5 || a.size() == 6) && a[0] == "export") {
      return export_dir(a[1], std::stoi(a[2]), a[3], a[4], a.size() == 6 ? std::stoull(a[5]) : 0);
    }
  } catch (const twobp::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
  std::fprintf(stderr,
               "usage: hf_probe forward HF_DIR CHUNKS BATCH OUT | hf_probe export HF_DIR CHUNKS OUT_DIR DTYPE "
               "[MAX_SHARD_BYTES] | hf_probe pipeline HF_DIR RANKS DP SCHEDULE MODE BATCH OUT [STEPS EXPORT_DIR]\n");
  return 2;
}
