#include "runtime/micro_batches.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "util/check.h"

namespace twobp::detail {
namespace {

// The rows (size of dimension 0, the dimension batches are split along) that every tensor of `batch` has; -1 when
// it has no tensor of dimension >= 1. Tensors that disagree would be split into pieces of different sizes, which
// broadcasting can then combine silently (a mask of 1 row against activations of 2): refused, naming them all.
int64_t common_rows(const NamedTensors& batch, const std::string& what) {
  int64_t rows = -1;
  bool agree = true;
  for (const auto& [name, t] : batch) {
    if (!t.defined() || t.dim() == 0) continue;
    if (rows < 0) rows = t.size(0);
    agree = agree && t.size(0) == rows;
  }
  if (!agree) {
    std::string sizes;
    for (const auto& [name, t] : batch) {
      if (!t.defined() || t.dim() == 0) continue;
      sizes += fmt::format("{}'{}': {}", sizes.empty() ? "" : ", ", name, t.size(0));
    }
    throw UsageError(fmt::format("{}: the tensors disagree on their number of rows (dimension 0, along which a "
                                 "batch is split into micro-batches): {}; give every tensor one row per sample",
                                 what, sizes));
  }
  return rows;
}

}  // namespace

void check_inputs_match_targets(const NamedTensors& inputs, const NamedTensors& targets, const std::string& what) {
  const int64_t in = common_rows(inputs, what + "'s inputs"), out = common_rows(targets, what + "'s targets");
  TWOBP_CHECK(in < 0 || out < 0 || in == out, UsageError,
              "{}: the inputs have {} rows ({{{}}}) and the targets {} ({{{}}}); they must describe the same samples",
              what, in, inputs.describe(), out, targets.describe());
}

std::vector<NamedTensors> split_into_micro_batches(const NamedTensors& batch, int m, int rank, int stage,
                                                   const char* what) {
  std::vector<NamedTensors> out(m);
  TWOBP_CHECK(!batch.empty(), UsageError, "rank {}: owns stage {} and needs the {} of the batch, got none", rank,
              stage, what);
  common_rows(batch, fmt::format("rank {} stage {}: the batch's {}", rank, stage, what));
  for (const auto& [name, t] : batch) {
    TWOBP_CHECK(t.defined() && t.dim() > 0 && t.size(0) % m == 0, UsageError,
                "rank {}: {} '{}' with {} samples cannot be split into {} micro-batches of equal size; pass the "
                "micro-batches one by one to split them unevenly",
                rank, what, name, t.defined() && t.dim() > 0 ? t.size(0) : 0, m);
    const auto pieces = t.split(t.size(0) / m);
    for (int k = 0; k < m; ++k) out[k].add(name, pieces[k]);
  }
  return out;
}

const std::vector<NamedTensors>& checked_micro_batches(const std::vector<NamedTensors>& given, int m, int rank,
                                                       int stage, const char* what) {
  TWOBP_CHECK(static_cast<int>(given.size()) == m, UsageError,
              "rank {}: owns stage {} and needs the {} of {} micro-batches, got {}", rank, stage, what, m,
              given.size());
  for (int k = 0; k < m; ++k) {
    TWOBP_CHECK(!given[k].empty(), UsageError, "rank {}: stage {} micro-batch {}: no {} given", rank, stage, k, what);
    common_rows(given[k], fmt::format("rank {} stage {} micro-batch {}: the {}", rank, stage, k, what));
  }
  return given;
}

}  // namespace twobp::detail
