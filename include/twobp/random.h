#pragma once
// Random numbers inside a stage's forward that do not depend on how ranks are run.
//
// LibTorch has one default generator per device for the whole process. When pipeline ranks are threads of one
// process (the Local transport) their forwards would draw from it in whatever order the threads interleave, so
// dropout masks -- and every result after them -- would change from run to run; saving and restoring it (as a
// replayed forward must) would disturb the other ranks' draws. twobp therefore gives every stage forward a
// generator of its own, keyed by
//
//     (seed, stage, micro-batch, pass)      pass: how many forwards of this micro-batch the stage ran before
//
// and draws nothing from the default generators itself. A forward that draws from stage_generator() (or uses
// twobp::nn::Dropout, which does) gets the same numbers whether ranks are threads or processes, under every
// schedule, with 2BP or fused backward, and again when activation recomputation replays it.
//
// A forward that draws from LibTorch's default generator instead (torch::nn::Dropout, torch::rand) is refused on
// its first step when ranks share the process (PipelineOptions / StageOptions::ranks_share_process) -- use
// twobp::nn::Dropout or stage_generator(), or run one rank per process (mpirun, torchrun); with one rank per
// process it is supported, and recomputation replays the default generator's state.

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace twobp {

/// The generator of the stage forward running on this thread, for `device` (CPU or a CUDA device), created on
/// first use in that forward and seeded from the key above. Outside a stage forward (no StageRandomScope on this
/// thread) it returns an undefined generator: callers then fall back to LibTorch's default (as nn::Dropout does).
at::Generator stage_generator(c10::Device device = c10::Device(c10::kCPU));

/// Installs the key of one stage forward for this thread, until destroyed; scopes nest (the inner one wins).
/// Stage opens one around every forward it runs. A reference computation without a pipeline opens the same scope
/// around each chunk's forward to draw the same numbers (the tests do).
class StageRandomScope {
 public:
  StageRandomScope(uint64_t seed, int stage, int micro_batch, int64_t pass);
  ~StageRandomScope();
  StageRandomScope(const StageRandomScope&) = delete;
  StageRandomScope& operator=(const StageRandomScope&) = delete;

  /// The seed the generators of this scope start from (the same for every device).
  uint64_t key() const { return key_; }
  at::Generator generator(c10::Device device);

 private:
  uint64_t key_;
  std::vector<std::pair<c10::Device, at::Generator>> generators_;  // at most one per device
  StageRandomScope* outer_;
};

}  // namespace twobp
