#pragma once
// The models of `twobp_bench pipeline --model` (no <torch/torch.h> here: pipeline_models.cpp is the one TU that
// builds torch::nn modules).
//
//   llama   twobp::models::LlamaChunk: fast-path layers (twobp::nn), balanced by compute (models::make_partition)
//   bert    BERT-like encoder from torch::nn modules (general autograd-graph split): token + learned position
//           embeddings + LayerNorm on stage 0; post-LN blocks (multi-head non-causal SDPA with biased Q/K/V/O
//           projections, LayerNorm, Linear-GELU-Linear FFN, LayerNorm); an MLM head (Linear, GELU, LayerNorm,
//           Linear to the vocabulary) on the last stage; cross entropy over all tokens
//   resnet  ResNet-like conv net (general path): a stem (3x3 conv, BatchNorm2d, ReLU) on stage 0; basic residual
//           blocks relu(x + BN(conv(relu(BN(conv(x)))))) that keep [C, H, W] (no downsampling, so every boundary
//           has the same shape); global average pool + Linear head on the last stage; cross entropy over classes
//
// bert and resnet partition their blocks evenly: stage s of S holds blocks [s·L/S, (s+1)·L/S) (integer division),
// so stage sizes differ by at most one block; L >= S is required (every stage holds a block). The embedding/stem
// and the head are extra work on the first and the last stage.

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
