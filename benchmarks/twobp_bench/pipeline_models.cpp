#include "pipeline_models.h"

#include <torch/torch.h>

#include <memory>
#include <mutex>

#include "twobp/error.h"
#include "twobp/models/llama.h"

namespace twobp::bench {
namespace {

// ---- BERT-like encoder (torch::nn only: general path) ----

struct BertLayerImpl : torch::nn::Module {
  BertLayerImpl(int64_t dim, int64_t heads, int64_t ffn) : dim(dim), heads(heads) {
    q = register_module("q", torch::nn::Linear(dim, dim));
    k = register_module("k", torch::nn::Linear(dim, dim));
    v = register_module("v", torch::nn::Linear(dim, dim));
    o = register_module("o", torch::nn::Linear(dim, dim));
    attn_norm = register_module("attn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, ffn));
    fc2 = register_module("fc2", torch::nn::Linear(ffn, dim));
    ffn_norm = register_module("ffn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1), hd = dim / heads;
    auto split_heads = [&](const torch::Tensor& t) { return t.view({b, s, heads, hd}).transpose(1, 2); };
    auto a = at::scaled_dot_product_attention(split_heads(q(x)), split_heads(k(x)), split_heads(v(x)), {}, 0.0,
                                              /*is_causal=*/false);
    auto h = attn_norm(x + o(a.transpose(1, 2).reshape({b, s, dim})));
    return ffn_norm(h + fc2(gelu(fc1(h))));
  }
  int64_t dim, heads;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm attn_norm{nullptr}, ffn_norm{nullptr};
  torch::nn::GELU gelu;
};
TORCH_MODULE(BertLayer);

struct BertChunkImpl : torch::nn::Module {
  BertChunkImpl(const PipelineModelArgs& a, int64_t first, int64_t end, bool embedding, bool head) {
    if (embedding) {
      tok = register_module("tok_embed", torch::nn::Embedding(a.vocab, a.dim));
      pos = register_module("pos_embed", torch::nn::Embedding(a.seq, a.dim));
      embed_norm = register_module("embed_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({a.dim})));
    }
    for (int64_t l = first; l < end; ++l) {
      layers.push_back(register_module("layer" + std::to_string(l), BertLayer(a.dim, a.heads, a.ffn)));
    }
    if (head) {
      head_dense = register_module("mlm_dense", torch::nn::Linear(a.dim, a.dim));
      head_norm = register_module("mlm_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({a.dim})));
      decoder = register_module("mlm_decoder", torch::nn::Linear(a.dim, a.vocab));
    }
  }
  torch::Tensor forward(const torch::Tensor& input) {
    torch::Tensor x = input;
    if (tok) {
      auto positions = torch::arange(input.size(1), torch::TensorOptions().dtype(torch::kLong));
      x = embed_norm(tok(input) + pos(positions));
    }
    for (auto& layer : layers) x = layer(x);
    if (decoder) x = decoder(head_norm(gelu(head_dense(x))));
    return x;
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::LayerNorm embed_norm{nullptr}, head_norm{nullptr};
  std::vector<BertLayer> layers;
  torch::nn::Linear head_dense{nullptr}, decoder{nullptr};
  torch::nn::GELU gelu;
};
TORCH_MODULE(BertChunk);

// ---- ResNet-like conv net (general path) ----

torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false));
}

struct ResBlockImpl : torch::nn::Module {
  explicit ResBlockImpl(int64_t c) {
    conv1 = register_module("conv1", conv3x3(c, c));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(c));
    conv2 = register_module("conv2", conv3x3(c, c));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(c));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(x + bn2(conv2(torch::relu(bn1(conv1(x)))))); }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(ResBlock);

struct ResNetChunkImpl : torch::nn::Module {
  ResNetChunkImpl(const PipelineModelArgs& a, int64_t first, int64_t end, bool stem, bool head) {
    if (stem) {
      stem_conv = register_module("stem_conv", conv3x3(a.in_channels, a.channels));
      stem_bn = register_module("stem_bn", torch::nn::BatchNorm2d(a.channels));
    }
    for (int64_t l = first; l < end; ++l) {
      blocks.push_back(register_module("block" + std::to_string(l), ResBlock(a.channels)));
    }
    if (head) fc = register_module("fc", torch::nn::Linear(a.channels, a.classes));
  }
  torch::Tensor forward(const torch::Tensor& input) {
    torch::Tensor x = input;
    if (stem_conv) x = torch::relu(stem_bn(stem_conv(x)));
    for (auto& block : blocks) x = block(x);
    if (fc) x = fc(x.mean({2, 3}));
    return x;
  }
  torch::nn::Conv2d stem_conv{nullptr};
  torch::nn::BatchNorm2d stem_bn{nullptr};
  std::vector<ResBlock> blocks;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNetChunk);

models::LlamaConfig llama_config(const PipelineModelArgs& a) {
  models::LlamaConfig config;
  config.name = "bench";
  config.dim = a.dim;
  config.n_layers = a.layers;
  config.n_heads = a.heads;
  config.n_kv_heads = a.kv_heads;
  config.ffn_dim = a.ffn;
  config.vocab_size = a.vocab;
  config.max_seq_len = a.seq;
  return config;
}

template <typename Holder>
PipelineChunk as_chunk(int stage, Holder module) {
  return {stage, module.ptr(), [module](const at::Tensor& x) mutable { return module->forward(x); }};
}

void require(bool ok, const std::string& what) {
  if (!ok) throw UsageError("pipeline --model: " + what);
}

}  // namespace

std::vector<std::string> pipeline_model_names() { return {"llama", "bert", "resnet"}; }

void validate_model(const PipelineModelArgs& a, int num_stages) {
  if (a.model == "llama") {
    llama_config(a).validate();
    return;
  }
  require(a.layers >= num_stages, "--layers " + std::to_string(a.layers) + " < " + std::to_string(num_stages) +
                                      " stages (blocks are partitioned evenly; every stage needs one)");
  require(a.micro_batch_size > 0, "--micro-batch-size must be positive");
  if (a.model == "bert") {
    require(a.dim > 0 && a.heads > 0 && a.dim % a.heads == 0, "--dim must be a positive multiple of --heads");
    require(a.ffn > 0 && a.vocab > 0 && a.seq > 0, "--ffn, --vocab and --seq must be positive");
  } else if (a.model == "resnet") {
    require(a.channels > 0 && a.image_size > 0 && a.in_channels > 0 && a.classes > 0,
            "--channels, --image-size, --in-channels and --classes must be positive");
  } else {
    require(false, "unknown model " + a.model + " (llama, bert, resnet)");
  }
}

std::vector<PipelineChunk> make_model_chunks(const PipelineModelArgs& a, const Schedule& schedule, int rank) {
  const int S = schedule.num_stages;
  validate_model(a, S);
  std::vector<PipelineChunk> chunks;
  if (a.model == "llama") {
    const models::LlamaConfig config = llama_config(a);
    const auto partition = models::make_partition(config, S, a.seq);
    for (int s : schedule.stages_of(rank)) chunks.push_back(as_chunk(s, models::LlamaChunk(config, partition.chunks[s], 1)));
    return chunks;
  }
  // Weights per stage from the global generator seeded by the stage: the same whatever the rank or thread that
  // builds it (ranks as threads build concurrently, hence the lock).
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  for (int s : schedule.stages_of(rank)) {
    const int64_t first = s * a.layers / S, end = (s + 1) * a.layers / S;
    torch::manual_seed(1000 + s);
    if (a.model == "bert") {
      chunks.push_back(as_chunk(s, BertChunk(a, first, end, s == 0, s == S - 1)));
    } else {
      chunks.push_back(as_chunk(s, ResNetChunk(a, first, end, s == 0, s == S - 1)));
    }
  }
  return chunks;
}

TensorSpec model_activation_spec(const PipelineModelArgs& a, int /*stage*/) {
  if (a.model == "resnet") return {{a.micro_batch_size, a.channels, a.image_size, a.image_size}, at::kFloat};
  return {{a.micro_batch_size, a.seq, a.dim}, at::kFloat};
}

LossFunction model_loss(const PipelineModelArgs& /*a*/) { return models::cross_entropy_loss; }

std::pair<at::Tensor, at::Tensor> make_model_batch(const PipelineModelArgs& a, int64_t batch, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  if (a.model == "resnet") {
    return {at::randn({batch, a.in_channels, a.image_size, a.image_size}, gen),
            at::randint(a.classes, {batch}, gen, at::kLong)};
  }
  at::Tensor tokens = at::randint(a.vocab, {batch, a.seq + 1}, gen, at::kLong);
  return {tokens.narrow(1, 0, a.seq).contiguous(), tokens.narrow(1, 1, a.seq).contiguous()};
}

int64_t tokens_per_sample(const PipelineModelArgs& a) { return a.model == "resnet" ? 0 : a.seq; }

}  // namespace twobp::bench
