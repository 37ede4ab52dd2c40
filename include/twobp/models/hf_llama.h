#pragma once
// Hugging Face Llama checkpoints in and out: transformers' LlamaForCausalLM (config.json + safetensors) as
// twobp's LlamaChunk (twobp/models/llama.h), and back.
//
//   models::LlamaConfig config = models::read_hf_llama_config("Llama-3.2-1B");   // DIR/config.json
//   models::LlamaRank rank = models::build_llama_rank(schedule, transport, {config, partition, seed}, po);
//   models::load_hf_llama("Llama-3.2-1B", config, rank.named);    // each rank reads only its own tensors
//   ... train ...
//   models::export_hf_llama("out", config, all_ranks_named);     // the caller gathers every rank's tensors
//
// Names: twobp                       transformers
//        embed.weight                model.embed_tokens.weight
//        layers.{i}.attn_norm.weight model.layers.{i}.input_layernorm.weight
//        layers.{i}.w{q,k,v,o}.weight model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
//        layers.{i}.mlp_norm.weight  model.layers.{i}.post_attention_layernorm.weight
//        layers.{i}.w1/w3/w2.weight  model.layers.{i}.mlp.gate_proj/up_proj/down_proj.weight  (silu(W1·m) ⊙ W3·m)
//        norm.weight                 model.norm.weight
//        head.weight                 lm_head.weight (absent with tie_word_embeddings: the head is the embedding)
// The weights need no permutation: transformers' Llama applies rotate-half rotary embeddings to the natural head
// layout of q_proj and k_proj, as twobp does (checked against transformers by tests/models/hf_compare.py).

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "twobp/models/llama.h"
#include "twobp/runtime/training_state.h"  // checkpoint::NamedTensors

namespace twobp::models {

/// The LlamaConfig of a transformers config.json (its text; `source` names it in errors). Read: hidden_size,
/// num_hidden_layers, num_attention_heads, num_key_value_heads (default: the heads), intermediate_size, vocab_size,
/// max_position_embeddings (-> max_seq_len; default 2048), rms_norm_eps (default 1e-6), tie_word_embeddings
/// (default false), and the rotary settings in either transformers' form: "rope_parameters" {rope_type,
/// rope_theta, ...} (transformers 5) or "rope_theta" + "rope_scaling" (4.x); rope types default (none), linear and
/// llama3 (original_max_position_embeddings defaulting to max_position_embeddings, as transformers does).
/// UsageError, naming the file, the key and what twobp needs, for: architectures without "LlamaForCausalLM" (or,
/// without architectures, a model_type other than "llama"), hidden_act other than "silu", attention_bias or
/// mlp_bias true, attention_dropout not 0, a head_dim other than hidden_size / num_attention_heads, a
/// partial_rotary_factor other than 1, any other rope type (dynamic, yarn, longrope, ...), a missing or mistyped
/// size, and a configuration LlamaConfig::validate() refuses.
LlamaConfig parse_hf_llama_config(const std::string& text, const std::string& source = "config.json");
/// parse_hf_llama_config of DIR/config.json (`path` a directory) or of the file `path`. IOError when unreadable.
LlamaConfig read_hf_llama_config(const std::string& path);

/// A config.json transformers' LlamaForCausalLM.from_pretrained loads as `config`: architectures, model_type and
/// every key parse_hf_llama_config reads, rotary settings in the 4.x form (rope_theta, rope_scaling), which
/// transformers 4 and 5 both read, and torch_dtype = `dtype`. `base`: the text of an existing config.json whose
/// other keys (token ids, generation settings, ...) are kept; empty: none. Keys sorted, indented by 2.
std::string hf_llama_config_json(const LlamaConfig& config, const std::string& base = {},
                                 at::ScalarType dtype = at::kFloat);

/// One parameter of the model: its twobp name, its transformers name and its shape under a config.
struct HfLlamaTensor {
  std::string name;     ///< twobp's ("layers.0.wq.weight")
  std::string hf_name;  ///< transformers' ("model.layers.0.self_attn.q_proj.weight")
  std::vector<int64_t> shape;
};
/// Every parameter of the whole model of `config`, in transformers' order (embedding, each layer's attention, MLP
/// and norms, final norm, head); without head.weight when the embeddings are tied.
std::vector<HfLlamaTensor> hf_llama_tensors(const LlamaConfig& config);
/// transformers' name of a twobp parameter name ("head.weight" -> "lm_head.weight"). UsageError for a name no
/// LlamaChunk has.
std::string hf_llama_name(const std::string& name);
/// twobp's name of a transformers tensor name; nullopt for a name outside the map.
std::optional<std::string> twobp_llama_name(const std::string& hf_name);

/// Loads `named` (twobp's global names -> destination tensors of any dtype and device, e.g. a LlamaRank's named,
/// float32 masters under mixed precision) from the checkpoint at `path` (a directory with model.safetensors or
/// model.safetensors.index.json, a .safetensors file or an index; checkpoint::SafetensorsCheckpoint), converting
/// each to its destination's dtype. Only the tensors of `named` are read (a rank reads its own).
///
/// The rule, checked on the headers before any tensor is copied and alike on every rank (so that all ranks refuse
/// a bad checkpoint, not just the one holding the bad tensor), each a UsageError naming the tensor and the file:
///   - every tensor the model of `config` has must be in the checkpoint, a floating dtype, with its shape;
///   - every tensor of the checkpoint must be one the model has (a tensor of layer n_layers, a bias or any other
///     unknown name means config.json and the weights disagree); ignored: model.layers.*.self_attn.rotary_emb
///     .inv_freq (derived, older checkpoints stored it) and, with tied embeddings, lm_head.weight when it equals
///     model.embed_tokens.weight (checked where embed.weight or head.weight is loaded);
///   - every name of `named` must be a parameter of the model of `config`, its destination of that shape.
/// With tied embeddings a "head.weight" in `named` loads model.embed_tokens.weight.
void load_hf_llama(const std::string& path, const LlamaConfig& config, const checkpoint::NamedTensors& named);
/// The same for every parameter of `chunk` (its config and checkpoint::module_tensors).
void load_hf_llama(const std::string& path, LlamaChunkImpl& chunk);

struct HfExportOptions {
  /// Converts every tensor to this dtype (e.g. at::kBFloat16); nullopt: each keeps its own.
  std::optional<at::ScalarType> dtype;
  /// 0: one model.safetensors. Otherwise shards of at most this many bytes plus model.safetensors.index.json.
  uint64_t max_shard_bytes = 0;
  /// The text of a config.json to keep other keys from (hf_llama_config_json's base), e.g. the imported one.
  std::string base_config;
  bool durable = true;  ///< fsync the files and the directory
};

/// Writes `tensors` -- every parameter of the model of `config` under twobp's global names (every rank's named
/// tensors, gathered by the caller) -- to DIR as transformers' LlamaForCausalLM: model.safetensors (or shards and
/// their index; checkpoint::save_safetensors, metadata {"format": "pt"}) and config.json
/// (hf_llama_config_json). UsageError, before anything is written, for a missing tensor, a wrong shape, a name the
/// model does not have (optimizer state, say), and with tied embeddings a head.weight that differs from
/// embed.weight. Returns the files written, config.json last.
std::vector<std::string> export_hf_llama(const std::string& dir, const LlamaConfig& config,
                                         const checkpoint::NamedTensors& tensors, const HfExportOptions& options = {});

}  // namespace twobp::models
