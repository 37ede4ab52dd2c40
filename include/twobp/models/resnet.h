#pragma once
// A ResNet-like conv net from LibTorch's own layers (general autograd-graph split; BatchNorm2d's running
// statistics are buffers the pipeline updates), cut into pipeline chunks: `twobp_bench pipeline --model resnet`.
//
// Architecture: a stem (3x3 conv, BatchNorm2d, ReLU; first chunk); basic residual blocks
// relu(x + BN(conv(relu(BN(conv(x)))))) that keep [channels, H, W] (no downsampling, so every stage boundary has
// the same shape); global average pool and a Linear head (last chunk). Stage s of S holds blocks
// even_blocks(layers, s, S) (twobp/models/bert.h). Initialisation is keyed by (seed, parameter name).
// Construction still draws from LibTorch's default generator (torch::nn layers initialise themselves before the
// name-keyed values replace theirs): with ranks as threads, build every rank's chunks before any rank steps.

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace twobp::models {

struct ResNetConfig {
  int64_t channels = 32, image_size = 16, in_channels = 3, classes = 10, layers = 4;
  /// UsageError naming the field unless every size is positive and every one of `num_stages` stages holds a block.
  void validate(int num_stages) const;
};

/// One basic residual block on [batch, channels, H, W].
class ResBlockImpl : public torch::nn::Module {
 public:
  explicit ResBlockImpl(int64_t channels);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr}, bn2_{nullptr};
};
TORCH_MODULE(ResBlock);

/// Stage `stage` of `num_stages`: images [batch, in_channels, H, W] in (first stage) or [batch, channels, H, W];
/// the same out, or logits [batch, classes] from the last stage.
class ResNetChunkImpl : public torch::nn::Module {
 public:
  ResNetChunkImpl(const ResNetConfig& config, int stage, int num_stages, uint64_t seed = 0);
  at::Tensor forward(const at::Tensor& input);

 private:
  torch::nn::Conv2d stem_conv_{nullptr};
  torch::nn::BatchNorm2d stem_bn_{nullptr};
  std::vector<ResBlock> blocks_;
  torch::nn::Linear fc_{nullptr};
};
TORCH_MODULE(ResNetChunk);

}  // namespace twobp::models
