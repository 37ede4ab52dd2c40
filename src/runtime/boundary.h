#pragma once
// The wire form of a stage boundary's NamedTensors when the sender announces shapes (no activation specs): a
// fixed-size int64 header -- so that the receiver can post it before knowing anything -- then one message per
// tensor that is present. Private to the runtime; the Executor is its only user.
//
// Header layout (int64 slots): magic, count, then per tensor: flags (1: present, 2: carries a gradient), dtype,
// ndim, dims..., name length, name bytes packed 8 per slot.

#include <ATen/core/Tensor.h>

#include <string>
#include <string_view>
#include <vector>

#include "twobp/tensors.h"

namespace twobp::detail {

/// Slots of a header: 2 KiB, room for e.g. 4 tensors of 4 dims with 24-character names.
constexpr int kHeaderSlots = 256;

/// What the header says about one tensor of the message.
struct AnnouncedTensor {
  std::string name;
  bool present = true;         ///< false: an undefined gradient (nothing depends on that tensor); no payload
  bool carries_gradient = false;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

/// Describes `tensors` (an undefined one is announced as absent). `carries_gradient` per tensor, same order.
std::vector<AnnouncedTensor> announce(const NamedTensors& tensors, const std::vector<bool>& carries_gradient);
/// The header of `announced`, a CPU int64 tensor of kHeaderSlots; UsageError naming `where` when it does not fit.
at::Tensor encode_header(const std::vector<AnnouncedTensor>& announced, std::string_view where);
/// Inverse of encode_header (`header` on any device); TransportError naming `where` for a malformed header.
std::vector<AnnouncedTensor> decode_header(const at::Tensor& header, std::string_view where);

}  // namespace twobp::detail
