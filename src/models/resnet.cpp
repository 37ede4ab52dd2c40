#include "twobp/models/resnet.h"

#include <ATen/ATen.h>

#include <string>

#include "models/init.h"
#include "twobp/error.h"
#include "twobp/models/bert.h"  // even_blocks
#include "util/check.h"

namespace twobp::models {
namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false));
}

}  // namespace

void ResNetConfig::validate(int num_stages) const {
  TWOBP_CHECK(channels > 0 && image_size > 0 && in_channels > 0 && classes > 0, UsageError,
              "ResNetConfig: channels {}, image_size {}, in_channels {} and classes {} must be positive", channels,
              image_size, in_channels, classes);
  TWOBP_CHECK(layers >= num_stages, UsageError,
              "ResNetConfig: {} layers for {} stages (blocks are split evenly; every stage needs one)", layers,
              num_stages);
}

ResBlockImpl::ResBlockImpl(int64_t c) {
  conv1_ = register_module("conv1", conv3x3(c, c));
  bn1_ = register_module("bn1", torch::nn::BatchNorm2d(c));
  conv2_ = register_module("conv2", conv3x3(c, c));
  bn2_ = register_module("bn2", torch::nn::BatchNorm2d(c));
}

at::Tensor ResBlockImpl::forward(const at::Tensor& x) { return at::relu(x + bn2_(conv2_(at::relu(bn1_(conv1_(x)))))); }

ResNetChunkImpl::ResNetChunkImpl(const ResNetConfig& c, int stage, int num_stages, uint64_t seed) {
  c.validate(num_stages);
  if (stage == 0) {
    stem_conv_ = register_module("stem_conv", conv3x3(c.in_channels, c.channels));
    stem_bn_ = register_module("stem_bn", torch::nn::BatchNorm2d(c.channels));
  }
  const auto [first, end] = even_blocks(c.layers, stage, num_stages);
  for (int64_t l = first; l < end; ++l) blocks_.push_back(register_module("block" + std::to_string(l), ResBlock(c.channels)));
  if (stage == num_stages - 1) fc_ = register_module("fc", torch::nn::Linear(c.channels, c.classes));
  detail::init_by_name(*this, seed);
}

at::Tensor ResNetChunkImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  if (stem_conv_) x = at::relu(stem_bn_(stem_conv_(x)));
  for (auto& block : blocks_) x = block(x);
  if (fc_) x = fc_(x.mean({2, 3}));
  return x;
}

}  // namespace twobp::models
