#pragma once
// A step's batch as micro-batches: split evenly along dimension 0, or given one by one, and checked (every tensor
// one row per sample; inputs and targets the same samples). Private to the runtime; the Executor's run() uses it.

#include <string>
#include <vector>

#include "twobp/tensors.h"

namespace twobp::detail {

/// `batch` split along dimension 0 into `m` micro-batches of equal size; UsageError naming `rank`, `stage` and
/// `what` ("inputs", "targets") when it is empty, its tensors disagree on their rows or do not divide by `m`.
std::vector<NamedTensors> split_into_micro_batches(const NamedTensors& batch, int m, int rank, int stage,
                                                   const char* what);
/// `given` as `m` micro-batches of `stage`: UsageError unless there are `m`, none empty, each one row per sample.
const std::vector<NamedTensors>& checked_micro_batches(const std::vector<NamedTensors>& given, int m, int rank,
                                                       int stage, const char* what);
/// Inputs and targets of one (micro-)batch, when a rank holds both the first and the last stage: the same samples
/// (one row each per sample); UsageError naming `what` otherwise.
void check_inputs_match_targets(const NamedTensors& inputs, const NamedTensors& targets, const std::string& what);

}  // namespace twobp::detail
