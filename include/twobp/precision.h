#pragma once
// How training keeps its tensors, in the one vocabulary of every program option, JSON field and label.

#include <c10/core/ScalarType.h>

#include <string_view>

namespace twobp {

enum class Precision {
  kFloat32,        ///< "fp32": everything in float32
  kMixedBFloat16,  ///< "bf16": bfloat16 compute, float32 master weights, gradients and optimizer state
  kBFloat16,       ///< "bf16-pure": everything in bfloat16
  kFloat64,        ///< "fp64": everything in float64 (parity checks against a reference, e.g. transformers')
};

/// "fp32", "bf16" (mixed), "bf16-pure" or "fp64".
const char* to_string(Precision precision);
/// Reads to_string()'s spellings and the aliases "float32" (fp32), "bf16-mixed" (bf16), "pure-bf16"
/// (bf16-pure) and "float64" (fp64). Throws UsageError naming the valid spellings otherwise -- also for "bfloat16", which could mean
/// either bfloat16 form, and for fp16, which twobp does not train in (no loss scaling).
Precision parse_precision(std::string_view text);

/// The dtype the chunks compute in: float32, bfloat16 (both bfloat16 forms) or float64.
c10::ScalarType compute_dtype(Precision precision);

}  // namespace twobp
