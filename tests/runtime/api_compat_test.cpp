// Code written against twobp 0.1 still compiles (with deprecation warnings) and means what it meant: the options
// that moved into PipelineOptions::executor in 0.2.0 are forwarded there (CHANGELOG.md). Part of pipeline_test.
// This file is compiled with the deprecation warnings it exists to produce.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "common/pipeline_fixtures.h"
#include "twobp/models/llama.h"
#include "twobp/error.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

// Every field as a 0.1 user wrote it (README and USAGE of 0.1: `options.activation_spec = ...`).
PipelineOptions options_written_for_0_1() {
  PipelineOptions options;
  options.loss = mse;
  options.timeout = std::chrono::seconds(7);
  options.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  options.prefetch_receives = 2;
  options.max_pending_weight_micro_batches = 3;
  options.memory_limit_bytes = 123;
  options.record_memory = true;
  options.memory_device = c10::Device(c10::kCPU);
  return options;
}

TEST(ApiCompat01, EveryMovedFieldIsForwardedToTheExecutorOptions) {
  const PipelineOptions moved = with_moved_executor_options(options_written_for_0_1());
  const ExecutorOptions& e = moved.executor;
  EXPECT_EQ(e.timeout, std::chrono::seconds(7));
  ASSERT_TRUE(static_cast<bool>(e.activation_spec));
  EXPECT_EQ(e.activation_spec(0).shape, (std::vector<int64_t>{kMicroBatchSize, kDim}));
  EXPECT_EQ(e.prefetch_receives, 2);
  EXPECT_EQ(e.max_pending_weight_micro_batches, 3);
  EXPECT_EQ(e.memory_limit_bytes, 123);
  EXPECT_TRUE(e.record_memory);
  ASSERT_TRUE(e.memory_device.has_value());
  EXPECT_EQ(*e.memory_device, c10::Device(c10::kCPU));
  EXPECT_FALSE(moved.timeout.assigned().has_value()) << "moved, not kept in both places";
  // The hooks of the old places: boundary_spec and overlap_forward_backward.
  PipelineOptions hooks;
  hooks.boundary_spec = [](int) { return BoundarySpec{}; };
  hooks.overlap_forward_backward = [](const Action&, const Action&, const std::function<void()>& f,
                                      const std::function<void()>& b) {
    f();
    b();
  };
  const PipelineOptions moved_hooks = with_moved_executor_options(hooks);
  EXPECT_TRUE(static_cast<bool>(moved_hooks.executor.boundary_spec));
  EXPECT_TRUE(static_cast<bool>(moved_hooks.executor.overlap_forward_backward));
  // Untouched 0.1 fields leave the executor's defaults.
  const PipelineOptions plain = with_moved_executor_options(PipelineOptions{});
  EXPECT_EQ(plain.executor.timeout, ExecutorOptions{}.timeout);
  EXPECT_FALSE(plain.executor.memory_device.has_value());
}

TEST(ApiCompat01, AFieldSetInBothPlacesIsRefusedByName) {
  for (const std::string field : {"timeout", "activation_spec", "memory_device"}) {
    SCOPED_TRACE(field);
    PipelineOptions options = options_written_for_0_1();
    if (field == "timeout") options.executor.timeout = std::chrono::seconds(9);
    if (field == "activation_spec") options.executor.activation_spec = [](int) { return TensorSpec{{1}, at::kDouble}; };
    if (field == "memory_device") options.executor.memory_device = c10::Device(c10::kCPU);
    try {
      with_moved_executor_options(options);
      ADD_FAILURE() << "expected a UsageError";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("PipelineOptions::" + field + " (deprecated since 0.2.0)"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("set only executor." + field), std::string::npos) << e.what();
    }
  }
}

// The Pipeline itself applies them: a 0.1 program's pipeline runs with the timeout it asked for.
TEST(ApiCompat01, APipelineBuiltFrom01OptionsUsesThem) {
  auto schedule = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  auto transports = make_local_transports(2);
  auto module = make_chunk(0);
  std::vector<PipelineChunk> chunks{{0, module, [raw = module.get()](const at::Tensor& x) {
                                       return run_chunk(*raw, 0, x);
                                     }}};
  PipelineOptions options;
  options.loss = mse;
  options.timeout = std::chrono::seconds(11);
  options.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  Pipeline pipeline(schedule, std::move(chunks), std::move(transports[0]), options);
  EXPECT_EQ(pipeline.options().executor.timeout, std::chrono::seconds(11));
  EXPECT_TRUE(static_cast<bool>(pipeline.options().executor.activation_spec));
}

// 0.1's training_precision(name): "bf16" meant everything in bfloat16, "bf16-mixed" mixed precision.
TEST(ApiCompat01, TrainingPrecisionByItsOldNames) {
  EXPECT_EQ(models::training_precision("bf16").precision, Precision::kBFloat16);
  EXPECT_EQ(models::training_precision("bf16-mixed").precision, Precision::kMixedBFloat16);
  EXPECT_EQ(models::training_precision("fp32").precision, Precision::kFloat32);
  EXPECT_THROW(models::training_precision("fp16"), UsageError);
}

}  // namespace
}  // namespace twobp::testing
