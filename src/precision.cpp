#include "twobp/precision.h"

#include <fmt/format.h>

#include <string>

#include "twobp/error.h"

namespace twobp {
namespace {

// Every spelling of a precision, the one to_string() writes first.
struct PrecisionSpelling {
  std::string_view text;
  Precision precision;
};
constexpr PrecisionSpelling kSpellings[] = {
    {"fp32", Precision::kFloat32},
    {"bf16", Precision::kMixedBFloat16},
    {"bf16-pure", Precision::kBFloat16},
    {"fp64", Precision::kFloat64},
    {"float32", Precision::kFloat32},
    {"bf16-mixed", Precision::kMixedBFloat16},
    {"pure-bf16", Precision::kBFloat16},
    {"float64", Precision::kFloat64},
};

constexpr std::string_view kValid =
    "fp32, bf16 (mixed precision: bfloat16 compute, float32 master weights, gradients and optimizer state) or "
    "bf16-pure (everything in bfloat16); fp64 for parity checks";

}  // namespace

const char* to_string(Precision precision) {
  for (const PrecisionSpelling& s : kSpellings) {
    if (s.precision == precision) return s.text.data();  // the table's literals end in '\0'
  }
  return "unknown";
}

Precision parse_precision(std::string_view text) {
  for (const PrecisionSpelling& s : kSpellings) {
    if (s.text == text) return s.precision;
  }
  if (text == "bfloat16") {
    throw UsageError(fmt::format("precision 'bfloat16' is ambiguous: say {}", kValid));
  }
  if (text == "fp16" || text == "float16" || text == "half") {
    throw UsageError(fmt::format("precision '{}' is not supported (float16 needs loss scaling, which twobp does "
                                 "not have): use {}",
                                 text, kValid));
  }
  throw UsageError(fmt::format("unknown precision '{}': expected {}", text, kValid));
}

c10::ScalarType compute_dtype(Precision precision) {
  switch (precision) {
    case Precision::kFloat32:
      return c10::kFloat;
    case Precision::kFloat64:
      return c10::kDouble;
    case Precision::kMixedBFloat16:
    case Precision::kBFloat16:
      break;
  }
  return c10::kBFloat16;
}

}  // namespace twobp
