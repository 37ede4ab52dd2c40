#pragma once
// Averages parameter gradients over a data-parallel group, bucket by bucket, each bucket started after the last
// weight-producing action of its stage (see DataParallelOptions in twobp/runtime/data_parallel.h).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "twobp/runtime/data_parallel.h"
#include "twobp/schedule/schedule.h"
#include "twobp/stage.h"

namespace twobp::detail {

class GradientReducer {
 public:
  /// The tensor whose .grad holds a parameter's gradient for the step: the parameter itself, or with mixed
  /// precision its float32 master (the compute parameter's .grad is moved there at every accumulation).
  using GradientHolder = std::function<at::Tensor(const at::Tensor& parameter)>;

  /// `stages`: this rank's chunks, by global index; `rank`: this rank in the pipeline (schedule) group; `holder`:
  /// see GradientHolder (null: the parameters themselves). Buckets are formed by the holders' dtype, so mixed
  /// precision reduces float32 gradients. Collective over the data-parallel group (checks that the replicas
  /// agree on the parameters).
  GradientReducer(const Schedule& schedule, int rank, const std::map<int, Stage*>& stages,
                  DataParallelOptions options, Duration timeout, const GradientHolder& holder = nullptr);
  ~GradientReducer();

  /// Before a step: remembers the buffers' versions (see finish()).
  void begin_step();
  /// Whether `parameter`'s gradient is in a bucket: it required grad when the reducer was built.
  bool reduces(const at::Tensor& parameter) const { return slot_.count(parameter.unsafeGetTensorImpl()) != 0; }
  /// For the W or B at `index` of this rank's list: when it is its stage's last weight action, the function that
  /// marks parameters final as it produces them (Stage::backward_weight's `done`; the Executor runs such a B as
  /// I and W); null otherwise.
  autograd::ParametersDone parameters_done(std::size_t index);
  /// After action `index` of this rank's list: every parameter of a stage whose last weight action it was is
  /// final; starts the buckets that are ready.
  void after_action(std::size_t index);
  /// Starts what has not started, waits for every bucket and writes the averaged gradients back. Returns the
  /// microseconds it took (the reduction time exposed after the rank's last action). Throws UsageError when a
  /// buffer changed during the step: each replica would have updated it from its own share of the batch only.
  double finish();
  /// Forgets the step after an error (unfinished reductions are dropped; their transport keeps buffers alive).
  void reset();

 private:
  struct Bucket {
    int stage = 0;                   // the chunk whose last weight action starts it
    std::vector<at::Tensor> params;  // the gradient holders (see GradientHolder); one dtype and device
    std::int64_t numel = 0;          // of the gradients (the flat buffer has params.size() more: the flags)
  };
  struct InFlight {
    std::size_t bucket = 0;
    at::Tensor flat;
    std::unique_ptr<Work> work;
  };

  struct Buffer {
    int stage = 0;
    std::string name;
    at::Tensor tensor;
    std::int64_t version = 0;  // at begin_step()
  };

  void mark_final(int stage, const std::vector<at::Tensor>& params);
  void mark_stage_final(int stage);
  /// Starts ready buckets in bucket order. WHY in order: the replicas' reductions are matched by their order,
  /// and which bucket becomes ready first may depend on a replica's data (a layer its micro-batches skip).
  void start_ready();
  void start(std::size_t bucket);
  void check_buffers() const;
  /// Writes the bucket's means into the parameters' .grad; `defined[k]` is its k-th parameter's flag (non-zero:
  /// defined on some replica).
  void write_back(InFlight& f, const double* defined);

  int rank_;
  DataParallelOptions options_;
  Duration timeout_;
  int dp_;
  std::vector<Bucket> buckets_;
  std::map<std::size_t, int> last_weight_action_;  // action index -> the stage it completes
  // Parameter (the compute tensor that W reports final) -> (bucket, index of its holder).
  std::map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> slot_;
  // Per step:
  std::vector<std::vector<bool>> final_;  // by bucket, by parameter
  std::vector<std::size_t> pending_;      // by bucket: parameters not final yet
  std::size_t next_ = 0;                  // the next bucket to start
  std::vector<InFlight> in_flight_;
  std::map<int, Stage*> stages_;
  std::vector<Buffer> buffers_;
};

}  // namespace twobp::detail
