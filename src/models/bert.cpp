#include "twobp/models/bert.h"

#include <ATen/ATen.h>

#include <string>

#include "models/init.h"
#include "twobp/error.h"
#include "util/check.h"

namespace twobp::models {

std::pair<int64_t, int64_t> even_blocks(int64_t layers, int stage, int num_stages) {
  TWOBP_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, UsageError,
              "even_blocks: stage {} of {} stages", stage, num_stages);
  return {stage * layers / num_stages, (stage + 1) * layers / num_stages};
}

void BertConfig::validate(int num_stages) const {
  TWOBP_CHECK(dim > 0 && heads > 0 && dim % heads == 0, UsageError,
              "BertConfig: dim {} must be a positive multiple of heads {}", dim, heads);
  TWOBP_CHECK(ffn > 0 && vocab > 0 && seq > 0, UsageError, "BertConfig: ffn {}, vocab {} and seq {} must be positive",
              ffn, vocab, seq);
  TWOBP_CHECK(layers >= num_stages, UsageError,
              "BertConfig: {} layers for {} stages (blocks are split evenly; every stage needs one)", layers,
              num_stages);
}

BertLayerImpl::BertLayerImpl(int64_t dim, int64_t heads, int64_t ffn) : dim_(dim), heads_(heads) {
  q_ = register_module("q", torch::nn::Linear(dim, dim));
  k_ = register_module("k", torch::nn::Linear(dim, dim));
  v_ = register_module("v", torch::nn::Linear(dim, dim));
  o_ = register_module("o", torch::nn::Linear(dim, dim));
  attn_norm_ = register_module("attn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  fc1_ = register_module("fc1", torch::nn::Linear(dim, ffn));
  fc2_ = register_module("fc2", torch::nn::Linear(ffn, dim));
  ffn_norm_ = register_module("ffn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
}

at::Tensor BertLayerImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1), hd = dim_ / heads_;
  auto split_heads = [&](const at::Tensor& t) { return t.view({b, s, heads_, hd}).transpose(1, 2); };
  const at::Tensor a = at::scaled_dot_product_attention(split_heads(q_(x)), split_heads(k_(x)), split_heads(v_(x)),
                                                        {}, 0.0, /*is_causal=*/false);
  const at::Tensor h = attn_norm_(x + o_(a.transpose(1, 2).reshape({b, s, dim_})));
  return ffn_norm_(h + fc2_(gelu_(fc1_(h))));
}

BertChunkImpl::BertChunkImpl(const BertConfig& c, int stage, int num_stages, uint64_t seed) {
  c.validate(num_stages);
  if (stage == 0) {
    tok_ = register_module("tok_embed", torch::nn::Embedding(c.vocab, c.dim));
    pos_ = register_module("pos_embed", torch::nn::Embedding(c.seq, c.dim));
    embed_norm_ = register_module("embed_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  }
  const auto [first, end] = even_blocks(c.layers, stage, num_stages);
  for (int64_t l = first; l < end; ++l) {
    layers_.push_back(register_module("layer" + std::to_string(l), BertLayer(c.dim, c.heads, c.ffn)));
  }
  if (stage == num_stages - 1) {
    head_dense_ = register_module("mlm_dense", torch::nn::Linear(c.dim, c.dim));
    head_norm_ = register_module("mlm_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    decoder_ = register_module("mlm_decoder", torch::nn::Linear(c.dim, c.vocab));
  }
  detail::init_by_name(*this, seed);
}

at::Tensor BertChunkImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  if (tok_) x = embed_norm_(tok_(input) + pos_(at::arange(input.size(1), input.options().dtype(at::kLong))));
  for (auto& layer : layers_) x = layer(x);
  if (decoder_) x = decoder_(head_norm_(gelu_(head_dense_(x))));
  return x;
}

}  // namespace twobp::models
