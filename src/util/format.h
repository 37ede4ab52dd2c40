#pragma once
// How errors describe tensors: one format everywhere, "[2, 4] Double"; and how text files are read.

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <string_view>

namespace twobp::detail {

inline std::string describe_shape(c10::IntArrayRef shape, at::ScalarType dtype) {
  return fmt::format("[{}] {}", fmt::join(shape, ", "), c10::toString(dtype));
}

/// `text` without a leading UTF-8 byte order mark (spreadsheet programs write one before a CSV), which a parser
/// would otherwise quote, invisible, as part of its first cell or line.
inline std::string_view without_utf8_bom(std::string_view text) {
  constexpr std::string_view kBom = "\xEF\xBB\xBF";
  return text.substr(0, kBom.size()) == kBom ? text.substr(kBom.size()) : text;
}

}  // namespace twobp::detail
