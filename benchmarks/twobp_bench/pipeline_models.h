#pragma once
// The models of `twobp_bench pipeline --model` (no <torch/torch.h> here), the library's (twobp/models/):
//   llama   LlamaChunk: fast-path layers (twobp::nn), balanced by compute (models::make_partition)
//   bert    BertChunk: a BERT-like encoder of torch::nn layers (general autograd-graph split), MLM head
//   resnet  ResNetChunk: a ResNet-like conv net of torch::nn layers with BatchNorm2d, classifier head
// bert and resnet split their blocks evenly (models::even_blocks); cross entropy over tokens or classes.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "twobp/runtime/pipeline.h"

namespace twobp::bench {

struct PipelineModelArgs {
  std::string model = "llama";  // llama | bert | resnet
  int64_t dim = 256, layers = 4, heads = 4, kv_heads = 4, ffn = 688, vocab = 256, seq = 128;
  int64_t channels = 32, image_size = 16, in_channels = 3, classes = 10;  // resnet
  int micro_batch_size = 4;
};

/// "llama", "bert", "resnet".
std::vector<std::string> pipeline_model_names();

/// Checks the dimensions (throws UsageError naming the field) for a pipeline of `num_stages` stages.
void validate_model(const PipelineModelArgs& a, int num_stages);

/// The chunks of `schedule` owned by `rank`, built from scratch (seeded, identical weights on every run).
std::vector<PipelineChunk> make_model_chunks(const PipelineModelArgs& a, const Schedule& schedule, int rank);

/// Exact output of `stage` for one micro-batch: [mbs, seq, dim] float (llama, bert), [mbs, C, H, W] float (resnet).
TensorSpec model_activation_spec(const PipelineModelArgs& a, int stage);

/// Loss of the last stage (mean cross entropy).
LossFunction model_loss(const PipelineModelArgs& a);

/// A random batch of `batch` samples: (inputs, targets). Tokens [batch, seq] and next tokens for llama and bert,
/// images [batch, in_channels, H, W] ~ N(0, 1) and class labels [batch] for resnet.
std::pair<at::Tensor, at::Tensor> make_model_batch(const PipelineModelArgs& a, int64_t batch, uint64_t seed);

/// Tokens per sample (seq), or 0 for models without tokens (resnet: report samples/s).
int64_t tokens_per_sample(const PipelineModelArgs& a);

}  // namespace twobp::bench
