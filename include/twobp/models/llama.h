#pragma once
// A LLaMa-like decoder-only language model, built from twobp's fast-path layers and cut into pipeline chunks.
//
// Architecture (per block, pre-norm):   h = x + Wo · SDPA_causal(rope(Wq·n), rope(Wk·n), Wv·n),  n = RMSNorm(x)
//                                       y = h + W2 · (silu(W1·m) ⊙ W3·m),                          m = RMSNorm(h)
// with grouped-query attention (n_kv_heads divides n_heads; K/V heads are repeated), rotary position embeddings
// (rotate-half convention) and no biases. The model is token embedding → n_layers blocks → RMSNorm → LM head.
//
// Pipelining: the model is never built whole. A Partition says, for each of the p·v chunks, which contiguous range
// of blocks it holds and whether it holds the embedding (chunk 0) or the final norm + head (last chunk); each rank
// constructs only the LlamaChunks of the stages it owns. Initialisation is keyed by (seed, parameter name) so the
// weights are identical whatever the partition, thread or process that builds them.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "twobp/nn/modules.h"
#include "twobp/precision.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/tensors.h"

namespace twobp::models {

/// How rotary frequencies are scaled for long contexts: none, transformers' "linear" (every inverse frequency
/// divided by `factor`) or "llama3" (Llama 3.1: low frequencies divided by `factor`, high ones kept, those between
/// interpolated; see rope_inverse_frequencies).
enum class RopeScalingType { kNone, kLinear, kLlama3 };
/// "none", "linear", "llama3".
std::string to_string(RopeScalingType type);
/// The inverse of to_string; UsageError listing the known names otherwise.
RopeScalingType parse_rope_scaling_type(std::string_view name);

/// transformers' rope_scaling (rope_parameters) of a Llama config.json.
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;                              ///< linear and llama3
  double low_freq_factor = 1.0;                     ///< llama3
  double high_freq_factor = 4.0;                    ///< llama3
  int64_t original_max_position_embeddings = 8192;  ///< llama3: the context length pre-training used
};

struct LlamaConfig {
  std::string name;
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t ffn_dim = 0;     ///< hidden size of the SwiGLU MLP
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;  ///< default training sequence length
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  /// Tied input/output embeddings (small Llama 3.2 models): the head is the embedding's table. In one chunk they
  /// are one tensor; split over chunks, the last chunk's head.weight is a copy initialised as embed.weight, and
  /// build_llama_rank declares the two copies a PipelineOptions::tied_parameters tie (their gradients summed every
  /// step), so the pipeline trains the tied model. The named configs are untied (as LLaMa).
  bool tie_embeddings = false;
  RopeScaling rope_scaling;  ///< default: none

  int64_t head_dim() const { return dim / n_heads; }
  int64_t kv_dim() const { return n_kv_heads * head_dim(); }
  /// Throws UsageError naming the inconsistent field (dim % heads, heads % kv_heads, odd head_dim, ...).
  void validate() const;
};

/// The rotary inverse frequencies of `config` (float32 [head_dim / 2], CPU): nn::rotary_inverse_frequencies(
/// head_dim, rope_theta), then scaled as rope_scaling says, with transformers' float32 operations
/// (modeling_rope_utils.py: linear scaling, _compute_llama3_parameters), so that an imported model's rotary tables
/// are bitwise those of transformers. llama3, with wavelength w = 2π / f of each frequency f, L the original
/// context length:  w > L / low_freq_factor: f / factor;  w < L / high_freq_factor: f;  between: (1 − s) · f /
/// factor + s · f with s = (L / w − low_freq_factor) / (high_freq_factor − low_freq_factor).
at::Tensor rope_inverse_frequencies(const LlamaConfig& config);

/// Named configurations:
///   tiny  dim 64,   4 layers,  4 heads,  2 kv heads, ffn 172,   vocab 256 (bytes), seq 64    (~0.2 M params)
///   small dim 256,  8 layers,  8 heads,  4 kv heads, ffn 688,   vocab 256 (bytes), seq 256   (~5.9 M params)
///   1b    dim 2048, 22 layers, 32 heads, 4 kv heads, ffn 5632,  vocab 32000,       seq 2048  (TinyLlama, 1.1 B)
///   7b    dim 4096, 32 layers, 32 heads, 32 kv heads, ffn 11008, vocab 32000,      seq 2048  (LLaMa-7B, 6.74 B)
std::vector<std::string> config_names();
/// Throws UsageError listing the known names when `name` is not one of them.
LlamaConfig config_by_name(std::string_view name);

/// Sizes that replace a configuration's own where > 0 (the `--dim --layers --heads --kv-heads --ffn --vocab`
/// options of llama_pipeline and `twobp_bench plan`).
struct LlamaDims {
  int64_t dim = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  bool any() const { return dim > 0 || layers > 0 || heads > 0 || kv_heads > 0 || ffn > 0 || vocab > 0; }
};

/// `base` with the sizes `dims` gives; named "<base>-custom" when it gives any. Throws UsageError (validate())
/// when the result is inconsistent, e.g. a --dim its heads do not divide.
LlamaConfig with_dims(LlamaConfig base, const LlamaDims& dims);

// ---- Analytic sizes (no allocation) ----

/// Parameters of one decoder block: 2 norms, Wq, Wk, Wv, Wo and the three MLP matrices.
int64_t block_parameter_count(const LlamaConfig& config);
int64_t embedding_parameter_count(const LlamaConfig& config);
/// Final RMSNorm + LM head (0 for the head matrix when embeddings are tied).
int64_t head_parameter_count(const LlamaConfig& config);
/// Total: embedding + n_layers blocks + final norm + head.
int64_t parameter_count(const LlamaConfig& config);

/// Forward FLOPs of one block for one sequence of `seq_len` tokens:
///   2 · seq · (block matrix parameters)            the GEMMs (Wq, Wk, Wv, Wo, W1, W2, W3)
/// + 2 · seq² · dim                                  QKᵀ and A·V with the causal mask halving 4 · seq² · dim
/// (norms, rotary and SwiGLU element-wise ops are O(seq · dim) and ignored). Backward ≈ 2× forward for every part,
/// so ratios between parts hold for F, B and I + W alike.
double block_forward_flops(const LlamaConfig& config, int64_t seq_len);
/// Forward FLOPs of the LM head for one sequence: 2 · seq · dim · vocab (one GEMM; the softmax is O(seq · vocab)).
double head_forward_flops(const LlamaConfig& config, int64_t seq_len);

// ---- Partitioning ----

/// One pipeline chunk: blocks [first_layer, end_layer), plus the embedding and/or final norm + head.
struct ChunkSpec {
  int first_layer = 0;
  int end_layer = 0;  ///< exclusive
  bool has_embedding = false;
  bool has_head = false;

  int num_layers() const { return end_layer - first_layer; }
  friend bool operator==(const ChunkSpec& a, const ChunkSpec& b) {
    return a.first_layer == b.first_layer && a.end_layer == b.end_layer && a.has_embedding == b.has_embedding &&
           a.has_head == b.has_head;
  }
};

/// The model cut into chunks (global stage order). Invariants: chunk 0 has the embedding, the last chunk has the
/// head, the block ranges are contiguous and cover [0, n_layers), every chunk but the first and the last holds at
/// least one block (the first may hold only the embedding, the last only the head, when asked explicitly).
struct Partition {
  std::vector<ChunkSpec> chunks;
  /// Estimated compute per chunk in units of one block's compute: blocks count 1 each, the head
  /// head_forward_flops / block_forward_flops, the embedding 0 (a gather).
  std::vector<double> cost;

  int num_chunks() const { return static_cast<int>(chunks.size()); }
  /// max(cost) / mean(cost): 1.0 is perfect balance.
  double imbalance() const;
  /// The layout string that reproduces this partition with make_partition ("8,8,8,8").
  std::string layout() const;
};

/// Cost of the head relative to one block at `seq_len` (see head_forward_flops / block_forward_flops).
double head_cost_in_blocks(const LlamaConfig& config, int64_t seq_len);

/// Cuts the model into `num_chunks` chunks.
///
/// `layout` empty: balanced by compute. Contiguous split minimising the most expensive chunk (exact dynamic
/// program; ties broken toward fewer blocks on later chunks), with the embedding on chunk 0 and the head's cost
/// added to the last chunk. The last chunk may be left with the head only when that balances best; every other
/// chunk gets at least one block.
///
/// `layout` given: comma-separated block counts, one per chunk, summing to n_layers, e.g. "3,3,2,0" for 8 layers
/// over 4 chunks: chunk 0 = embedding + blocks 0-2, chunk 1 = blocks 3-5, chunk 2 = blocks 6-7, chunk 3 = final
/// norm + head only. Only the first chunk (embedding only) and the last (head only) may be 0.
///
/// Throws UsageError (before anything is allocated) when the model cannot be split: more chunks than
/// n_layers + 1, a malformed layout, a wrong count or sum, or an empty middle chunk.
Partition make_partition(const LlamaConfig& config, int num_chunks, int64_t seq_len, std::string_view layout = {});

// ---- Modules ----

// ---- Packed sequences ----

/// Names of the tensors a chunk takes and returns in its NamedTensors form (LlamaChunkImpl::forward).
constexpr const char* kTokens = "tokens";        ///< first chunk's input: ids [batch, seq] int64
constexpr const char* kHidden = "hidden";        ///< between chunks: [batch, seq, dim], differentiable
constexpr const char* kPositions = "positions";  ///< [batch, seq] int64, position within its document
constexpr const char* kDocIds = "doc_ids";       ///< [batch, seq] int64, document of each token (attention mask)
constexpr const char* kTargets = "targets";      ///< loss: next-token ids [batch, seq] int64
constexpr const char* kLossMask = "loss_mask";   ///< loss: 1 where the target continues the input's document

/// Packing: rows that hold several documents back to back, each ended by `separator`. Returns, for token ids
/// [batch, seq], the document index of every token (0, 1, ... per row; a separator belongs to the document it
/// ends) and its position within its document (restarting at 0 after every separator).
struct PackedDocuments {
  at::Tensor doc_ids;
  at::Tensor positions;
};
PackedDocuments pack_documents(const at::Tensor& tokens, int64_t separator);

/// The inputs of the first chunk and the targets of the loss for a packed batch: tokens, positions and doc_ids;
/// targets and loss_mask (0 where the next token starts another document: nothing predicts across documents).
NamedTensors packed_inputs(const at::Tensor& tokens, int64_t separator);
NamedTensors packed_targets(const at::Tensor& tokens, const at::Tensor& targets, int64_t separator);

/// Mean cross entropy over the tokens whose loss_mask is 1 (outputs: "logits"; targets: kTargets, kLossMask).
at::Tensor masked_cross_entropy_loss(const NamedTensors& outputs, const NamedTensors& targets);
/// Their sum, not mean (LossReduction::kMeanOverItems divides by the global batch's count).
at::Tensor summed_masked_cross_entropy_loss(const NamedTensors& outputs, const NamedTensors& targets);
/// The dtype the LLaMa losses compute in: float64 for float64 logits (parity checks), float32 for any other.
at::ScalarType loss_dtype(at::ScalarType logits);

// ---- Modules ----

/// One decoder block. Input and output [batch, seq, dim]. With `positions` ([batch, seq] int64, each below
/// max(seq, max_seq_len)) rotary angles follow them instead of 0..seq-1; with `doc_ids` a token attends only to
/// earlier tokens of its own document (document masking), else to all earlier tokens (causal).
class LlamaBlockImpl : public torch::nn::Module {
 public:
  /// `rotary`: rotary tables shared with other blocks (a chunk shares one); null: the block makes its own.
  explicit LlamaBlockImpl(const LlamaConfig& config,
                          std::shared_ptr<const twobp::nn::RotaryEmbedding> rotary = nullptr);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions = {}, const at::Tensor& doc_ids = {});

  LlamaConfig config;
  std::shared_ptr<const twobp::nn::RotaryEmbedding> rotary;  ///< one autograd node per use (nn::functional)
  twobp::nn::RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  twobp::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(LlamaBlock);

/// A contiguous piece of the model.
///   first chunk:  ids [batch, seq] (int64)  -> hidden [batch, seq, dim]
///   middle chunk: hidden                    -> hidden
///   last chunk:   hidden (or ids if it is also the first) -> logits [batch, seq, vocab]
/// Parameter names are global ("layers.5.wq.weight", "embed.weight", "norm.weight", "head.weight"), so a
/// checkpoint shard or a comparison against a one-chunk model can match parameters by name.
///
/// Initialisation: every parameter is drawn from a CPU generator seeded by hash(seed, global name): Linear and
/// Embedding weights N(0, 0.02²), the residual output projections (wo, w2) N(0, (0.02/√(2·n_layers))²) (GPT-2
/// scaling), norm scales 1. Hence equal weights for equal (config, seed) under any partition.
class LlamaChunkImpl : public torch::nn::Module {
 public:
  LlamaChunkImpl(const LlamaConfig& config, const ChunkSpec& spec, uint64_t seed = 0);
  at::Tensor forward(const at::Tensor& input);
  /// Packed sequences: takes kTokens (first chunk) or kHidden, plus kPositions and kDocIds; returns kHidden (or
  /// "logits" from the last chunk) with kPositions and kDocIds passed on (no gradient: they are integers).
  NamedTensors forward(const NamedTensors& inputs);

  const LlamaConfig& config() const { return config_; }
  const ChunkSpec& spec() const { return spec_; }

  twobp::nn::Embedding embed{nullptr};        ///< first chunk only
  std::vector<LlamaBlock> blocks;             ///< registered as "layers.<global index>"
  twobp::nn::RMSNorm norm{nullptr};           ///< last chunk only
  twobp::nn::Linear head{nullptr};            ///< last chunk only

 private:
  at::Tensor run(const at::Tensor& input, const at::Tensor& positions, const at::Tensor& doc_ids);
  LlamaConfig config_;
  ChunkSpec spec_;
};
TORCH_MODULE(LlamaChunk);

/// Mean cross entropy over all tokens: logits [batch, seq, vocab] (any float dtype; computed in loss_dtype), targets
/// [batch, seq] int64. Usable as PipelineOptions::loss.
at::Tensor cross_entropy_loss(const at::Tensor& logits, const at::Tensor& targets);
/// The sum over all tokens (LossReduction::kMeanOverItems).
at::Tensor summed_cross_entropy_loss(const at::Tensor& logits, const at::Tensor& targets);

// ---- Memory estimates (for dry runs; nothing is allocated) ----

/// Bytes of activations one micro-batch keeps alive on a chunk between its forward and its (last) backward, for a
/// micro-batch of `batch` sequences of `seq_len` tokens at `bytes_per_element`. Per block, counting the tensors
/// autograd (or the 2BP weight-gradient store) saves:
///   attention: RMSNorm input and normalised output (2·d), q, k, v after rotary (d + 2·kv), k, v repeated to all
///              heads (2·d), SDPA output (d), its [batch, seq, dim] copy fed to Wo (d)        = 7·d + 2·kv
///   MLP:       residual + RMSNorm input and normalised output (2·d), W1 and W3 outputs (2·f), silu(W1) (f),
///              the product fed to W2 (f)                                                   = 2·d + 4·f
///   total per token ≈ 9·d + 2·kv + 4·f elements (flash-style SDPA: no seq² attention matrix is kept).
/// Embedding chunk: its output, d per token. Head chunk: final norm (2·d) plus logits and their float32
/// log-softmax for the loss, (bytes + 4)·vocab per token.
int64_t chunk_activation_bytes(const LlamaConfig& config, const ChunkSpec& spec, int64_t batch, int64_t seq_len,
                               int64_t bytes_per_element);
/// Parameters of one chunk (embedding, blocks, final norm and head as present).
int64_t chunk_parameter_count(const LlamaConfig& config, const ChunkSpec& spec);

/// Bytes a micro-batch keeps on a chunk between its I and its W under 2BP: the fast-path layers' (input,
/// grad_output) pairs (twobp::nn: Linear keeps x and dY, RMSNorm x̂ and dY, Embedding the ids and dY). Per block
/// and token: RMSNorm x̂ and dY twice (4·d), the attention input shared by Wq, Wk, Wv (d) and their dY
/// (d + 2·kv), Wo's input and dY (2·d), the MLP input shared by W1, W3 (d) and their dY (2·f), W2's input (f) and
/// dY (d) = 10·d + 2·kv + 3·f elements. Embedding chunk: ids (8 bytes) and dY (d) per token. Head chunk: the final
/// norm's x̂ and dY and the head's input (3·d) and dY (vocab) per token.
int64_t chunk_pending_weight_bytes(const LlamaConfig& config, const ChunkSpec& spec, int64_t batch, int64_t seq_len,
                                   int64_t bytes_per_element);

/// How training keeps its tensors, for memory estimates: bytes per parameter of the weights the chunks compute
/// with, of fp32 master weights (0: none), of gradients, and of AdamW's two moments together.
struct TrainingPrecision {
  Precision precision = Precision::kFloat32;
  int64_t compute_bytes = 4;
  int64_t master_bytes = 0;
  int64_t gradient_bytes = 4;
  int64_t optimizer_bytes = 8;
};
/// fp32 {4, 0, 4, 8}; bf16 (mixed: bfloat16 compute, fp32 masters, gradients and AdamW state) {2, 4, 4, 8};
/// bf16-pure (everything in bfloat16) {2, 0, 2, 4}; fp64 {8, 0, 8, 16}.
TrainingPrecision training_precision(Precision precision);
/// Deprecated in 0.2.0 (CHANGELOG.md): 0.1's names, where "bf16" meant everything in bfloat16 (now
/// Precision::kBFloat16, "bf16-pure") and "bf16-mixed" meant mixed precision (now Precision::kMixedBFloat16).
[[deprecated("use training_precision(twobp::parse_precision(name)); 0.1's \"bf16\" is \"bf16-pure\" now")]]
TrainingPrecision training_precision(const std::string& name);

/// What a dry run needs to estimate each rank's peak memory in training.
struct MemoryPlanOptions {
  int64_t micro_batch_size = 1;
  int64_t seq_len = 0;
  TrainingPrecision precision;
  bool recompute = false;
  /// With recompute: only the stages of these pipeline ranks recompute (ascending, as twobp::recomputing_ranks
  /// gives them; empty: every rank).
  std::vector<int> recompute_ranks;
  /// Replicas the optimizer state is sharded over (twobp::ShardedOptimizer, ZeRO-1): each rank holds 1/n of it
  /// (an even split; the greedy split by whole tensors is within one tensor of it). 1: not sharded.
  int optimizer_shards = 1;
  /// Replicas the gradients are sharded over (ZeRO-2, DataParallelOptions::zero = 2; set optimizer_shards too):
  /// each rank keeps 1/n of its gradients between steps. A stage with one weight action per step (2BP with W
  /// batched once per step) holds its full gradient only while that W runs (released bucket by bucket: counted
  /// whole during the W, an upper bound); a stage with several (W per micro-batch, or B) accumulates the full
  /// gradient until its last one, and is counted whole from its first W/B to the step's end. 1: not sharded.
  int gradient_shards = 1;
};

/// Per rank: the estimate and its parts, in bytes.
struct RankMemoryEstimate {
  int64_t parameters = 0;
  double weights = 0, master_weights = 0, optimizer = 0, gradients = 0;
  double activations = 0;       ///< peak of the live activations alone (W's pairs costing nothing)
  double pending_weights = 0;   ///< what the W's pairs add to that peak (2BP's deferred work)
  double total = 0;             ///< simulate_peak_memory(schedule, memory_model(...)): everything at once
};

/// The twobp::MemoryModel of a LLaMa partition under `schedule` from the formulas above: base = weights + masters
/// + AdamW state per rank; per stage F keeps its activations (with recompute only its input, re-running the forward
/// in I or B), I frees them but the pending-W pairs, W frees those, B frees all; each stage's first W or B
/// allocates its gradients. Message buffers are not counted.
twobp::MemoryModel memory_model(const LlamaConfig& config, const Partition& partition, const twobp::Schedule& schedule,
                                const MemoryPlanOptions& options);
/// Each rank's estimate (simulate_peak_memory of the model above, with its parts).
std::vector<RankMemoryEstimate> estimate_memory(const LlamaConfig& config, const Partition& partition,
                                                const twobp::Schedule& schedule, const MemoryPlanOptions& options);

}  // namespace twobp::models
