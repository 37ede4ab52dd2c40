#include "twobp/models/llama.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/ranges.h>

#include "twobp/error.h"
#include "twobp/nn/functional.h"
#include "twobp/plan/recompute.h"
#include "twobp/schedule/simulate.h"
#include "util/check.h"
#include "util/hash.h"

namespace twobp::models {

namespace {

LlamaConfig make_config(std::string name, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                        int64_t vocab, int64_t seq) {
  LlamaConfig c;
  c.name = std::move(name);
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.ffn_dim = ffn;
  c.vocab_size = vocab;
  c.max_seq_len = seq;
  return c;
}

const std::vector<LlamaConfig>& named_configs() {
  static const std::vector<LlamaConfig> configs = {
      make_config("tiny", 64, 4, 4, 2, 172, 256, 64),
      make_config("small", 256, 8, 8, 4, 688, 256, 256),
      make_config("1b", 2048, 22, 32, 4, 5632, 32000, 2048),
      make_config("7b", 4096, 32, 32, 32, 11008, 32000, 2048),
  };
  return configs;
}

using twobp::detail::fnv1a;
using twobp::detail::mix64;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

twobp::nn::Linear linear(int64_t in, int64_t out) {
  return twobp::nn::Linear(twobp::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

std::string to_string(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kLinear:
      return "linear";
    case RopeScalingType::kLlama3:
      return "llama3";
    case RopeScalingType::kNone:
      break;
  }
  return "none";
}

RopeScalingType parse_rope_scaling_type(std::string_view name) {
  for (auto type : {RopeScalingType::kNone, RopeScalingType::kLinear, RopeScalingType::kLlama3}) {
    if (name == to_string(type)) return type;
  }
  twobp::detail::raise<UsageError>("unknown rope scaling '{}': known are none, linear, llama3", name);
}

at::Tensor rope_inverse_frequencies(const LlamaConfig& c) {
  const at::Tensor inv = twobp::nn::rotary_inverse_frequencies(c.head_dim(), c.rope_theta);
  const RopeScaling& r = c.rope_scaling;
  if (r.type == RopeScalingType::kNone) return inv;
  c10::AutoGradMode no_grad(false);
  if (r.type == RopeScalingType::kLinear) return inv / r.factor;
  // transformers' _compute_llama3_parameters, operation for operation in float32 (a Python number over a tensor,
  // `x / t`, is t.reciprocal() * x there; comparisons and arithmetic with Python floats round them to float32).
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / r.low_freq_factor;
  const double high_freq_wavelen = old_len / r.high_freq_factor;
  const at::Tensor wavelen = at::reciprocal(inv) * (2 * M_PI);
  const at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv / r.factor, inv);
  const at::Tensor smooth =
      (at::reciprocal(wavelen) * old_len - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed = at::rsub(smooth, 1) * scaled / r.factor + smooth * scaled;
  const at::Tensor medium = at::logical_not(wavelen < high_freq_wavelen) & at::logical_not(wavelen > low_freq_wavelen);
  return at::where(medium, smoothed, scaled);
}

void LlamaConfig::validate() const {
  TWOBP_CHECK(dim > 0 && n_layers > 0 && n_heads > 0 && n_kv_heads > 0 && ffn_dim > 0 && vocab_size > 0 &&
                  max_seq_len > 0,
              UsageError, "model '{}': every size must be positive (dim {}, layers {}, heads {}, kv heads {}, ffn {}, "
              "vocab {}, seq {})", name, dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, max_seq_len);
  TWOBP_CHECK(dim % n_heads == 0, UsageError, "model '{}': dim {} is not divisible by n_heads {}", name, dim,
              n_heads);
  TWOBP_CHECK(n_heads % n_kv_heads == 0, UsageError, "model '{}': n_heads {} is not divisible by n_kv_heads {}",
              name, n_heads, n_kv_heads);
  TWOBP_CHECK(head_dim() % 2 == 0, UsageError, "model '{}': head_dim {} must be even for rotary embeddings", name,
              head_dim());
  TWOBP_CHECK(rope_theta > 0, UsageError, "model '{}': rope_theta must be positive, got {}", name, rope_theta);
  const RopeScaling& r = rope_scaling;
  TWOBP_CHECK(r.type == RopeScalingType::kNone || r.factor > 0, UsageError,
              "model '{}': rope scaling '{}' needs a positive factor, got {}", name, to_string(r.type), r.factor);
  TWOBP_CHECK(r.type != RopeScalingType::kLlama3 ||
                  (r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor &&
                   r.original_max_position_embeddings > 0),
              UsageError, "model '{}': llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and a "
              "positive original_max_position_embeddings, got {}, {} and {}", name, r.low_freq_factor,
              r.high_freq_factor, r.original_max_position_embeddings);
}

std::vector<std::string> config_names() {
  std::vector<std::string> names;
  for (const auto& c : named_configs()) names.push_back(c.name);
  return names;
}

LlamaConfig config_by_name(std::string_view name) {
  for (const auto& c : named_configs()) {
    if (c.name == name) return c;
  }
  throw UsageError(fmt::format("unknown model '{}': known models are {}", name, fmt::join(config_names(), ", ")));
}

LlamaConfig with_dims(LlamaConfig c, const LlamaDims& d) {
  if (!d.any()) return c;
  if (d.dim > 0) c.dim = d.dim;
  if (d.layers > 0) c.n_layers = d.layers;
  if (d.heads > 0) c.n_heads = d.heads;
  if (d.kv_heads > 0) c.n_kv_heads = d.kv_heads;
  if (d.ffn > 0) c.ffn_dim = d.ffn;
  if (d.vocab > 0) c.vocab_size = d.vocab;
  c.name += "-custom";
  c.validate();
  return c;
}

int64_t block_parameter_count(const LlamaConfig& c) {
  const int64_t attention = c.dim * c.dim * 2 + c.dim * c.kv_dim() * 2;  // Wq, Wo; Wk, Wv
  const int64_t mlp = 3 * c.dim * c.ffn_dim;
  return attention + mlp + 2 * c.dim;  // + two RMSNorm scales
}

int64_t embedding_parameter_count(const LlamaConfig& c) { return c.vocab_size * c.dim; }

int64_t head_parameter_count(const LlamaConfig& c) {
  return c.dim + (c.tie_embeddings ? 0 : c.vocab_size * c.dim);
}

int64_t parameter_count(const LlamaConfig& c) {
  return embedding_parameter_count(c) + c.n_layers * block_parameter_count(c) + head_parameter_count(c);
}

double block_forward_flops(const LlamaConfig& c, int64_t seq_len) {
  const double s = static_cast<double>(seq_len);
  const double gemm_params = static_cast<double>(block_parameter_count(c) - 2 * c.dim);
  return 2.0 * s * gemm_params + 2.0 * s * s * static_cast<double>(c.dim);
}

double head_forward_flops(const LlamaConfig& c, int64_t seq_len) {
  return 2.0 * static_cast<double>(seq_len) * static_cast<double>(c.dim) * static_cast<double>(c.vocab_size);
}

double head_cost_in_blocks(const LlamaConfig& c, int64_t seq_len) {
  return head_forward_flops(c, seq_len) / block_forward_flops(c, seq_len);
}

// ---- Partition ----

double Partition::imbalance() const {
  if (cost.empty()) return 1.0;
  const double mean = std::accumulate(cost.begin(), cost.end(), 0.0) / static_cast<double>(cost.size());
  return mean > 0.0 ? *std::max_element(cost.begin(), cost.end()) / mean : 1.0;
}

std::string Partition::layout() const {
  std::vector<int> counts;
  for (const auto& c : chunks) counts.push_back(c.num_layers());
  return fmt::format("{}", fmt::join(counts, ","));
}

namespace {

Partition from_counts(const LlamaConfig& config, const std::vector<int>& counts, double head_cost) {
  Partition p;
  int layer = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    ChunkSpec spec;
    spec.first_layer = layer;
    spec.end_layer = layer + counts[i];
    spec.has_embedding = i == 0;
    spec.has_head = i + 1 == counts.size();
    layer = spec.end_layer;
    p.chunks.push_back(spec);
    p.cost.push_back(counts[i] + (spec.has_head ? head_cost : 0.0));
  }
  return p;
}

std::vector<int> parse_layout(const LlamaConfig& config, int num_chunks, std::string_view layout) {
  std::vector<int> counts;
  std::size_t pos = 0;
  while (pos <= layout.size()) {
    const std::size_t comma = std::min(layout.find(',', pos), layout.size());
    std::string_view item = layout.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    int value = -1;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    TWOBP_CHECK(!item.empty() && ec == std::errc() && end == item.data() + item.size() && value >= 0, UsageError,
                "partition layout '{}': item {} ('{}') is not a non-negative block count", layout, counts.size(),
                item);
    counts.push_back(value);
    pos = comma + 1;
  }
  TWOBP_CHECK(static_cast<int>(counts.size()) == num_chunks, UsageError,
              "partition layout '{}' has {} entries but the pipeline has {} chunks (stages x chunks per rank)", layout,
              counts.size(), num_chunks);
  const int64_t sum = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  TWOBP_CHECK(sum == config.n_layers, UsageError, "partition layout '{}' places {} blocks but model '{}' has {}",
              layout, sum, config.name, config.n_layers);
  for (int i = 1; i + 1 < num_chunks; ++i) {
    TWOBP_CHECK(counts[i] > 0, UsageError,
                "partition layout '{}': chunk {} is empty (only the first chunk may hold just the embedding and the "
                "last just the head)", layout, i);
  }
  return counts;
}

// Exact min-max contiguous split: chunks 0..C-2 get >= 1 block, the last >= 0 and carries the head's cost.
std::vector<int> balance(int layers, int chunks, double head_cost) {
  const double inf = std::numeric_limits<double>::infinity();
  // best[c][j]: minimal max cost of chunks 0..c-1 (none of them the last) covering blocks [0, j).
  std::vector<std::vector<double>> best(chunks, std::vector<double>(layers + 1, inf));
  best[0][0] = 0.0;
  for (int c = 1; c < chunks; ++c) {
    for (int j = c; j <= layers; ++j) {
      for (int i = c - 1; i < j; ++i) {
        if (best[c - 1][i] == inf) continue;
        best[c][j] = std::min(best[c][j], std::max(best[c - 1][i], static_cast<double>(j - i)));
      }
    }
  }
  // Last chunk: blocks [i, layers) plus the head. Prefer the largest i (fewest blocks late) among the optima.
  double optimum = inf;
  int split = -1;
  for (int i = chunks - 1; i <= layers; ++i) {
    const double v = std::max(best[chunks - 1][i], (layers - i) + head_cost);
    if (v <= optimum + 1e-12) {
      optimum = std::min(optimum, v);
      split = i;
    }
  }
  std::vector<int> counts(chunks, 0);
  counts[chunks - 1] = layers - split;
  int j = split;
  for (int c = chunks - 1; c >= 1; --c) {
    // Find a split i for chunks 0..c-1 within the optimum, taking as few blocks for chunk c-1 as possible... but
    // the chain must stay feasible: best[c-1][i] <= optimum and (j - i) <= optimum.
    int chosen = -1;
    for (int i = j - 1; i >= c - 1; --i) {
      if (best[c - 1][i] <= optimum + 1e-12 && (j - i) <= optimum + 1e-12) {
        chosen = i;
        break;
      }
    }
    counts[c - 1] = j - chosen;
    j = chosen;
  }
  return counts;
}

}  // namespace

Partition make_partition(const LlamaConfig& config, int num_chunks, int64_t seq_len, std::string_view layout) {
  config.validate();
  TWOBP_CHECK(num_chunks >= 1, UsageError, "model '{}': the number of chunks must be positive, got {}", config.name,
              num_chunks);
  TWOBP_CHECK(num_chunks <= config.n_layers + 1, UsageError,
              "model '{}' cannot be split into {} chunks: it has {} blocks, and every chunk except the last (which may "
              "hold only the head) needs at least one block, so at most {} chunks are possible",
              config.name, num_chunks, config.n_layers, config.n_layers + 1);
  const double head_cost = head_cost_in_blocks(config, seq_len > 0 ? seq_len : config.max_seq_len);
  const int layers = static_cast<int>(config.n_layers);
  std::vector<int> counts =
      layout.empty() ? balance(layers, num_chunks, head_cost) : parse_layout(config, num_chunks, layout);
  return from_counts(config, counts, head_cost);
}

// ---- Modules ----

LlamaBlockImpl::LlamaBlockImpl(const LlamaConfig& c, std::shared_ptr<const twobp::nn::RotaryEmbedding> rotary_tables)
    : config(c),
      rotary(rotary_tables ? std::move(rotary_tables)
                           : std::make_shared<const twobp::nn::RotaryEmbedding>(rope_inverse_frequencies(c),
                                                                                c.max_seq_len)) {
  attn_norm = register_module("attn_norm", twobp::nn::RMSNorm(twobp::nn::RMSNormOptions(c.dim).eps(c.norm_eps)));
  wq = register_module("wq", linear(c.dim, c.dim));
  wk = register_module("wk", linear(c.dim, c.kv_dim()));
  wv = register_module("wv", linear(c.dim, c.kv_dim()));
  wo = register_module("wo", linear(c.dim, c.dim));
  mlp_norm = register_module("mlp_norm", twobp::nn::RMSNorm(twobp::nn::RMSNormOptions(c.dim).eps(c.norm_eps)));
  w1 = register_module("w1", linear(c.dim, c.ffn_dim));
  w3 = register_module("w3", linear(c.dim, c.ffn_dim));
  w2 = register_module("w2", linear(c.ffn_dim, c.dim));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& doc_ids) {
  const int64_t b = x.size(0), s = x.size(1), hd = config.head_dim();
  auto h = attn_norm(x);
  auto q = wq(h).view({b, s, config.n_heads, hd}).transpose(1, 2);
  auto k = wk(h).view({b, s, config.n_kv_heads, hd}).transpose(1, 2);
  auto v = wv(h).view({b, s, config.n_kv_heads, hd}).transpose(1, 2);
  const twobp::nn::RotaryEmbedding::Tables rope = rotary->tables(q, positions);  // the same for k
  q = twobp::nn::functional::rotary_embedding(q, rope.cos, rope.sin_signed);
  k = twobp::nn::functional::rotary_embedding(k, rope.cos, rope.sin_signed);
  if (const int64_t rep = config.n_heads / config.n_kv_heads; rep > 1) {
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
  }
  at::Tensor a;
  if (doc_ids.defined()) {
    // Document masking: causal, and only within the token's own document. [batch, 1, seq, seq], true = attend.
    const at::Tensor same = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1);
    const at::Tensor causal = at::ones({s, s}, doc_ids.options().dtype(at::kBool)).tril();
    a = at::scaled_dot_product_attention(q, k, v, (same & causal).unsqueeze(1), 0.0, /*is_causal=*/false);
  } else {
    a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  }
  auto y = x + wo(a.transpose(1, 2).reshape({b, s, config.dim}));
  auto m = mlp_norm(y);
  return y + w2(at::silu(w1(m)) * w3(m));
}

LlamaChunkImpl::LlamaChunkImpl(const LlamaConfig& config, const ChunkSpec& spec, uint64_t seed)
    : config_(config), spec_(spec) {
  config.validate();
  TWOBP_CHECK(spec.first_layer >= 0 && spec.first_layer <= spec.end_layer && spec.end_layer <= config.n_layers,
              UsageError, "model '{}': chunk blocks [{}, {}) are outside [0, {})", config.name, spec.first_layer,
              spec.end_layer, config.n_layers);
  TWOBP_CHECK(spec.num_layers() > 0 || spec.has_embedding || spec.has_head, UsageError,
              "model '{}': a chunk with no blocks, embedding or head would be empty", config.name);
  if (spec.has_embedding) embed = register_module("embed", twobp::nn::Embedding(config.vocab_size, config.dim));
  if (spec.num_layers() > 0) {
    auto layers = register_module("layers", std::make_shared<torch::nn::Module>());
    // One set of rotary tables for all blocks.
    auto rotary =
        std::make_shared<const twobp::nn::RotaryEmbedding>(rope_inverse_frequencies(config), config.max_seq_len);
    for (int i = spec.first_layer; i < spec.end_layer; ++i) {
      blocks.push_back(layers->register_module(std::to_string(i), LlamaBlock(config, rotary)));
    }
  }
  if (spec.has_head) {
    norm = register_module("norm", twobp::nn::RMSNorm(twobp::nn::RMSNormOptions(config.dim).eps(config.norm_eps)));
    head = register_module("head", linear(config.dim, config.vocab_size));
    // Tied embeddings: one tensor where the chunk also holds the embedding; else a copy of its own, initialised as
    // the embedding (below), that the pipeline keeps equal to it (PipelineOptions::tied_parameters, set by build_llama_rank).
    if (config.tie_embeddings && spec.has_embedding) head->tie_weight(embed->weight);
  }

  // Deterministic, partition-independent initialisation (see the header).
  const double std_default = 0.02;
  const double std_residual = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layers));
  c10::AutoGradMode no_grad(false);
  for (const auto& item : named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool tied_head = config.tie_embeddings && name == "head.weight";
    if (tied_head && spec.has_embedding) continue;  // the embedding's table
    if (ends_with(name, "norm.weight")) {
      p.fill_(1.0);
      continue;
    }
    // A tied head of its own (the embedding on another chunk) draws the embedding's values.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(mix64(seed ^ fnv1a(tied_head ? "embed.weight" : name)));
    const double std = (ends_with(name, ".wo.weight") || ends_with(name, ".w2.weight")) ? std_residual : std_default;
    p.normal_(0.0, std, gen);
  }
}

at::Tensor LlamaChunkImpl::forward(const at::Tensor& input) { return run(input, {}, {}); }

at::Tensor LlamaChunkImpl::run(const at::Tensor& input, const at::Tensor& positions, const at::Tensor& doc_ids) {
  at::Tensor h = input;
  if (spec_.has_embedding) {
    TWOBP_CHECK(input.dim() == 2 && input.scalar_type() == at::kLong, UsageError,
                "model '{}': the first chunk takes token ids [batch, seq] int64, got [{}] {}", config_.name,
                fmt::join(input.sizes(), ", "), c10::toString(input.scalar_type()));
    h = embed(input);
  } else {
    TWOBP_CHECK(input.dim() == 3 && input.size(2) == config_.dim, UsageError,
                "model '{}': chunk of blocks [{}, {}) takes hidden states [batch, seq, {}], got [{}]", config_.name,
                spec_.first_layer, spec_.end_layer, config_.dim, fmt::join(input.sizes(), ", "));
  }
  for (auto& block : blocks) h = block->forward(h, positions, doc_ids);
  if (spec_.has_head) h = head(norm(h));
  return h;
}

NamedTensors LlamaChunkImpl::forward(const NamedTensors& in) {
  const at::Tensor& positions = in[kPositions];
  const at::Tensor& doc_ids = in[kDocIds];
  at::Tensor out = run(spec_.has_embedding ? in[kTokens] : in[kHidden], positions, doc_ids);
  if (spec_.has_head) return NamedTensors{{"logits", out}};
  return NamedTensors{{kHidden, out}, {kPositions, positions}, {kDocIds, doc_ids}};
}

PackedDocuments pack_documents(const at::Tensor& tokens, int64_t separator) {
  TWOBP_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, UsageError,
              "pack_documents: token ids must be [batch, seq] int64, got [{}] {}", fmt::join(tokens.sizes(), ", "),
              c10::toString(tokens.scalar_type()));
  // A token after a separator starts a new document: doc = number of separators strictly before it.
  const at::Tensor ends = (tokens == separator).to(at::kLong);
  const at::Tensor doc_ids = ends.cumsum(1) - ends;
  // Position = index - index of the document's first token; the first token's index is the running maximum of
  // "index where a document starts".
  const int64_t seq = tokens.size(1);
  const at::Tensor index = at::arange(seq, tokens.options()).expand_as(tokens);
  const at::Tensor starts = at::where(doc_ids != at::roll(doc_ids, 1, 1), index, at::zeros_like(index));
  const at::Tensor first = std::get<0>(at::cummax(starts, 1));
  return {doc_ids, index - first};
}

NamedTensors packed_inputs(const at::Tensor& tokens, int64_t separator) {
  const PackedDocuments docs = pack_documents(tokens, separator);
  return NamedTensors{{kTokens, tokens}, {kPositions, docs.positions}, {kDocIds, docs.doc_ids}};
}

NamedTensors packed_targets(const at::Tensor& tokens, const at::Tensor& targets, int64_t separator) {
  // The target of token i is token i + 1; it continues i's document unless token i ends it.
  const at::Tensor mask = (tokens != separator).to(at::kFloat);
  return NamedTensors{{kTargets, targets}, {kLossMask, mask}};
}

at::ScalarType loss_dtype(at::ScalarType logits) { return logits == at::kDouble ? at::kDouble : at::kFloat; }

namespace {

// Every token's cross entropy, flat, in loss_dtype.
at::Tensor token_losses(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t vocab = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, vocab}).to(loss_dtype(logits.scalar_type())),
                                targets.to(logits.device()).reshape({-1}), {}, at::Reduction::None);
}

// The masked tokens' losses summed, and the mask's sum.
std::pair<at::Tensor, at::Tensor> masked_sum(const NamedTensors& outputs, const NamedTensors& targets) {
  const at::Tensor per_token = token_losses(outputs["logits"], targets[kTargets]);
  const at::Tensor mask = targets[kLossMask].to(per_token.device()).reshape({-1}).to(per_token.scalar_type());
  return {(per_token * mask).sum(), mask.sum()};
}

}  // namespace

at::Tensor masked_cross_entropy_loss(const NamedTensors& outputs, const NamedTensors& targets) {
  const auto [sum, count] = masked_sum(outputs, targets);
  return sum / count.clamp_min(1.0);
}

at::Tensor summed_masked_cross_entropy_loss(const NamedTensors& outputs, const NamedTensors& targets) {
  return masked_sum(outputs, targets).first;
}

at::Tensor cross_entropy_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return token_losses(logits, targets).mean();
}

at::Tensor summed_cross_entropy_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return token_losses(logits, targets).sum();
}

int64_t chunk_parameter_count(const LlamaConfig& c, const ChunkSpec& spec) {
  int64_t n = spec.num_layers() * block_parameter_count(c);
  if (spec.has_embedding) n += embedding_parameter_count(c);
  if (spec.has_head) n += head_parameter_count(c);
  if (spec.has_head && c.tie_embeddings && !spec.has_embedding) n += c.vocab_size * c.dim;  // the head's copy
  return n;
}

int64_t chunk_activation_bytes(const LlamaConfig& c, const ChunkSpec& spec, int64_t batch, int64_t seq_len,
                               int64_t bytes_per_element) {
  const int64_t tokens = batch * seq_len;
  int64_t elements = spec.num_layers() * tokens * (9 * c.dim + 2 * c.kv_dim() + 4 * c.ffn_dim);
  if (spec.has_embedding) elements += tokens * c.dim;
  int64_t bytes = elements * bytes_per_element;
  if (spec.has_head) bytes += tokens * (2 * c.dim * bytes_per_element + (bytes_per_element + 4) * c.vocab_size);
  return bytes;
}

int64_t chunk_pending_weight_bytes(const LlamaConfig& c, const ChunkSpec& spec, int64_t batch, int64_t seq_len,
                                   int64_t bytes_per_element) {
  const int64_t tokens = batch * seq_len;
  int64_t bytes = spec.num_layers() * tokens * (10 * c.dim + 2 * c.kv_dim() + 3 * c.ffn_dim) * bytes_per_element;
  if (spec.has_embedding) bytes += tokens * (8 + c.dim * bytes_per_element);
  if (spec.has_head) bytes += tokens * (3 * c.dim + c.vocab_size) * bytes_per_element;
  return bytes;
}

TrainingPrecision training_precision(Precision precision) {
  switch (precision) {
    case Precision::kMixedBFloat16:
      return {precision, 2, 4, 4, 8};
    case Precision::kBFloat16:
      return {precision, 2, 0, 2, 4};
    case Precision::kFloat64:
      return {precision, 8, 0, 8, 16};
    case Precision::kFloat32:
      break;
  }
  return {Precision::kFloat32, 4, 0, 4, 8};
}

TrainingPrecision training_precision(const std::string& name) {
  if (name == "fp32") return training_precision(Precision::kFloat32);
  if (name == "bf16") return training_precision(Precision::kBFloat16);  // 0.1's meaning: everything in bfloat16
  if (name == "bf16-mixed") return training_precision(Precision::kMixedBFloat16);
  twobp::detail::raise<UsageError>("training_precision: unknown precision '{}' (0.1's names: fp32, bf16, bf16-mixed)", name);
}

namespace {

// Bytes of a chunk's input for one micro-batch: token ids on the first chunk, else the hidden state.
int64_t chunk_input_bytes(const LlamaConfig& c, const ChunkSpec& spec, int64_t batch, int64_t seq_len,
                          int64_t bytes_per_element) {
  return batch * seq_len * (spec.has_embedding ? 8 : c.dim * bytes_per_element);
}

// AdamW state per parameter on one rank: all of it, or its share when sharded over the replicas.
double optimizer_bytes_per_parameter(const MemoryPlanOptions& o) {
  TWOBP_CHECK(o.optimizer_shards >= 1, UsageError, "memory plan: optimizer_shards must be >= 1, got {}",
              o.optimizer_shards);
  return static_cast<double>(o.precision.optimizer_bytes) / o.optimizer_shards;
}

// ZeRO-2 (MemoryPlanOptions::gradient_shards): the part of stage s's gradient (`full` bytes) that lives only while
// its W runs, when that W is its only weight action of the step (else 0: the full gradient accumulates until the
// last one, which the model cannot single out).
double zero2_transient(const twobp::Schedule& schedule, int s, const MemoryPlanOptions& o, double full) {
  TWOBP_CHECK(o.gradient_shards >= 1, UsageError, "memory plan: gradient_shards must be >= 1, got {}",
              o.gradient_shards);
  if (o.gradient_shards == 1) return 0.0;
  int weight_actions = 0;
  std::size_t micro_batches = 1;  // of the one W: simulate_peak_memory scales a W's rise by them
  for (const auto& a : schedule.actions[schedule.stage_to_rank[s]]) {
    if (a.stage != s || !twobp::makes_weight_grads(a.type)) continue;
    ++weight_actions;
    if (a.type == twobp::ActionType::kBackwardWeight) micro_batches = std::max<std::size_t>(1, a.micro_batches.size());
  }
  return weight_actions == 1 ? full * (1.0 - 1.0 / o.gradient_shards) / static_cast<double>(micro_batches) : 0.0;
}

twobp::MemoryModel make_memory_model(const LlamaConfig& c, const Partition& partition,
                                     const twobp::Schedule& schedule, const MemoryPlanOptions& o,
                                     bool pending_costs) {
  TWOBP_CHECK(partition.num_chunks() == schedule.num_stages, UsageError,
              "memory_model: the partition has {} chunks, the schedule {} stages", partition.num_chunks(),
              schedule.num_stages);
  const TrainingPrecision& pr = o.precision;
  const int64_t b = pr.compute_bytes;
  twobp::MemoryModel model;
  model.base.assign(schedule.num_ranks, 0.0);
  model.stages.resize(schedule.num_stages);
  model.gradients.resize(schedule.num_stages);
  for (int s = 0; s < schedule.num_stages; ++s) {
    const ChunkSpec& spec = partition.chunks[s];
    const double n = static_cast<double>(chunk_parameter_count(c, spec));
    model.base[schedule.stage_to_rank[s]] += n * (static_cast<double>(pr.compute_bytes + pr.master_bytes) +
                                                  optimizer_bytes_per_parameter(o));
    model.gradients[s] = n * static_cast<double>(pr.gradient_bytes);
    // ZeRO-2 (gradient_shards): what lives only during the stage's one W, per micro-batch of it.
    const double sharded_away = zero2_transient(schedule, s, o, model.gradients[s]);
    if (sharded_away > 0) model.gradients[s] /= o.gradient_shards;
    const double act = static_cast<double>(chunk_activation_bytes(c, spec, o.micro_batch_size, o.seq_len, b));
    const double pend =
        pending_costs ? static_cast<double>(chunk_pending_weight_bytes(c, spec, o.micro_batch_size, o.seq_len, b))
                      : 0.0;
    // With recomputation F keeps only the input; I and B re-run the forward first (rising to the activations).
    const bool recompute = o.recompute && (o.recompute_ranks.empty() ||
                                           twobp::has_rank(o.recompute_ranks, schedule.stage_to_rank[s]));
    const double kept =
        recompute ? static_cast<double>(chunk_input_bytes(c, spec, o.micro_batch_size, o.seq_len, b)) : act;
    const double opens = recompute ? act - kept : 0.0;  // what I or B adds back before it starts
    auto& m = model.stages[s];
    m[static_cast<int>(twobp::ActionType::kForward)] = {kept, recompute ? act : kept};
    m[static_cast<int>(twobp::ActionType::kBackwardInput)] = {pend - kept, opens};
    m[static_cast<int>(twobp::ActionType::kBackwardWeight)] = {-pend, sharded_away};
    m[static_cast<int>(twobp::ActionType::kBackward)] = {-kept, opens};
  }
  return model;
}

}  // namespace

twobp::MemoryModel memory_model(const LlamaConfig& config, const Partition& partition, const twobp::Schedule& schedule,
                                const MemoryPlanOptions& options) {
  return make_memory_model(config, partition, schedule, options, /*pending_costs=*/true);
}

std::vector<RankMemoryEstimate> estimate_memory(const LlamaConfig& c, const Partition& partition,
                                                const twobp::Schedule& schedule, const MemoryPlanOptions& o) {
  const auto total = twobp::simulate_peak_memory(schedule, make_memory_model(c, partition, schedule, o, true));
  // The parts: the same walk over activations alone (no weights, state, gradients; W pairs free), then with the
  // W pairs; the difference is what deferring W's adds at the peak.
  auto activations_only = [&](bool pending) {
    twobp::MemoryModel m = make_memory_model(c, partition, schedule, o, pending);
    std::fill(m.base.begin(), m.base.end(), 0.0);
    m.gradients.clear();
    return twobp::simulate_peak_memory(schedule, m);
  };
  const auto live = activations_only(false), live_and_pending = activations_only(true);
  std::vector<RankMemoryEstimate> out(schedule.num_ranks);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    RankMemoryEstimate& e = out[r];
    for (int s : schedule.stages_of(r)) e.parameters += chunk_parameter_count(c, partition.chunks[s]);
    const double n = static_cast<double>(e.parameters);
    e.weights = n * static_cast<double>(o.precision.compute_bytes);
    e.master_weights = n * static_cast<double>(o.precision.master_bytes);
    e.optimizer = n * optimizer_bytes_per_parameter(o);
    e.gradients = n * static_cast<double>(o.precision.gradient_bytes) / o.gradient_shards;  // kept between steps
    e.total = total[r];
    e.activations = live[r];
    e.pending_weights = std::max(0.0, live_and_pending[r] - live[r]);
  }
  return out;
}

}  // namespace twobp::models
