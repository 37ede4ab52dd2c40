#pragma once
// Mixed precision for one rank's chunks (PipelineOptions::mixed_precision): float32 master weights behind
// modules that compute in a lower precision. Internal to the Pipeline.
//
// At construction every trainable floating parameter gets a float32 master (a copy of its float32 value), then
// the modules are converted to the compute dtype (Module::to: parameters keep their identity, buffers follow).
// Each compute parameter's gradient goes to its master's float32 .grad (autograd::set_master_gradient): the
// fast-path kernels add theirs there directly (on CUDA a bfloat16 GEMM writes its product there in float32),
// and a post-accumulate-grad hook moves what autograd accumulated (one micro-batch's) there, so gradients
// accumulate over micro-batches in float32 whatever the compute dtype. The optimizer steps the masters; sync()
// copies them back into the compute parameters (rounding once) before every step.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace twobp::detail {

class MasterWeights {
 public:
  /// `modules`: this rank's chunks, by stage; `rank` names errors. Throws UsageError for a trainable parameter that
  /// is not float32, or that already has a post-accumulate-grad hook (there is one slot per tensor).
  MasterWeights(const std::map<int, std::shared_ptr<torch::nn::Module>>& modules, at::ScalarType compute_dtype,
                int rank);

  /// The float32 master of a compute parameter, or `t` itself when it has none (frozen, not floating).
  at::Tensor master_of(const at::Tensor& t) const;
  /// Whether `t` has a master: it required grad when the masters were made.
  bool has_master(const at::Tensor& t) const { return by_compute_.count(t.unsafeGetTensorImpl()) != 0; }
  /// Copies every master into its compute parameter (no autograd). Throws UsageError, before copying, when a
  /// compute parameter was written in place since the last copy (or since construction): the copy would silently
  /// undo that write, which belongs on the master.
  void sync();

 private:
  struct Entry {
    at::Tensor compute, master;
    int stage = 0;             // of the (first) chunk listing it, for errors
    std::string name;          // the parameter's name in that chunk
    std::int64_t version = 0;  // the compute parameter's version after the last copy from the master
  };
  int rank_ = 0;
  std::vector<Entry> entries_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> by_compute_;
};

}  // namespace twobp::detail
