#include "pipeline_models.h"

#include <torch/torch.h>


#include "twobp/error.h"
#include "twobp/models/bert.h"
#include "twobp/models/llama.h"
#include "twobp/models/resnet.h"

namespace twobp::bench {
namespace {

models::BertConfig bert_config(const PipelineModelArgs& a) {
  return {a.dim, a.layers, a.heads, a.ffn, a.vocab, a.seq};
}

models::ResNetConfig resnet_config(const PipelineModelArgs& a) {
  return {a.channels, a.image_size, a.in_channels, a.classes, a.layers};
}

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

}  // namespace

std::vector<std::string> pipeline_model_names() { return {"llama", "bert", "resnet"}; }

void validate_model(const PipelineModelArgs& a, int num_stages) {
  if (a.micro_batch_size <= 0) throw UsageError("pipeline --model: --micro-batch-size must be positive");
  if (a.model == "llama") {
    llama_config(a).validate();
  } else if (a.model == "bert") {
    bert_config(a).validate(num_stages);
  } else if (a.model == "resnet") {
    resnet_config(a).validate(num_stages);
  } else {
    throw UsageError("pipeline --model: unknown model " + a.model + " (llama, bert, resnet)");
  }
}

std::vector<PipelineChunk> make_model_chunks(const PipelineModelArgs& a, const Schedule& schedule, int rank) {
  const int S = schedule.num_stages;
  validate_model(a, S);
  std::vector<PipelineChunk> chunks;
  const auto partition = a.model == "llama" ? models::make_partition(llama_config(a), S, a.seq) : models::Partition{};
  for (int s : schedule.stages_of(rank)) {
    if (a.model == "llama") {
      chunks.push_back(as_chunk(s, models::LlamaChunk(llama_config(a), partition.chunks[s], 1)));
    } else if (a.model == "bert") {
      chunks.push_back(as_chunk(s, models::BertChunk(bert_config(a), s, S, /*seed=*/1000)));
    } else {
      chunks.push_back(as_chunk(s, models::ResNetChunk(resnet_config(a), s, S, /*seed=*/1000)));
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
