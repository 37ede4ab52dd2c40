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
// Exit status 0 on success; 3 with the message on stderr when twobp refuses (a twobp::Error), 2 on bad usage.

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"
#include "twobp/models/hf_llama.h"
#include "twobp/models/llama.h"
#include "twobp/runtime/training_state.h"

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
    if ((a.size() == 5 || a.size() == 6) && a[0] == "export") {
      return export_dir(a[1], std::stoi(a[2]), a[3], a[4], a.size() == 6 ? std::stoull(a[5]) : 0);
    }
  } catch (const twobp::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
  std::fprintf(stderr,
               "usage: hf_probe forward HF_DIR CHUNKS BATCH OUT | hf_probe export HF_DIR CHUNKS OUT_DIR DTYPE "
               "[MAX_SHARD_BYTES]\n");
  return 2;
}
