#pragma once
// How errors describe tensors: one format everywhere, "[2, 4] Double".

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>

namespace twobp::detail {

inline std::string describe_shape(c10::IntArrayRef shape, at::ScalarType dtype) {
  return fmt::format("[{}] {}", fmt::join(shape, ", "), c10::toString(dtype));
}

}  // namespace twobp::detail
