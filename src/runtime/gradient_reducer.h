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

  // ---- ZeroStage::k2 (DataParallelOptions::zero): sharded gradients ----
  // At construction every bucket's gradient holders become views of one flat buffer of the bucket (their values
  // copied in); this replica owns shard_range(bucket numel, dp, replica) of it. A bucket is reduce-scattered
  // (instead of all-reduced) when it starts, its holders' full .grad released then; finish() leaves the mean in
  // the shard's .grad (added to what it held: steps without zero_grad accumulate, as .grad does).

  bool sharded() const { return sharded_; }
  /// This replica's shard of every bucket, in bucket order: views of the flat weights (an optimizer stepping them
  /// writes the working weights, or the masters), .grad the averaged shard gradient after finish(). Some may be
  /// empty (a bucket smaller than dp).
  std::vector<at::Tensor> shards() const;
  /// The stage (global index) whose parameters the k-th shard holds.
  int shard_stage(std::size_t k) const { return buckets_[k].stage; }
  /// Releases every shard's .grad (Pipeline::zero_grad).
  void zero_shard_grads();
  /// Collective over the group: every replica's (updated) shards into every replica's flat buffers, i.e. the
  /// working weights (async all-gathers where the transport has them, then one wait each).
  void gather_shards();
  /// One slice of a bucket: `holder` occupies [offset, offset + numel) of bucket `bucket`'s flat buffer.
  struct Slice {
    at::Tensor holder;
    std::size_t bucket = 0;
    std::int64_t offset = 0;
  };
  /// Every trainable holder's place in the flat layout (checkpoints map shards to parameter names with it).
  std::vector<Slice> layout() const;
  /// This replica's range of bucket `k`.
  ShardRange shard_range_of(std::size_t k) const { return buckets_[k].range; }
  /// Bytes this replica sent in data-parallel collectives during the last finished step (ring-algorithm bytes:
  /// all-reduce 2(dp-1)/dp n, reduce-scatter (dp-1)/dp n; see collective_bytes_sent) and, for ZeRO-2, the
  /// all-gathers since (gather_shards adds to it).
  std::int64_t bytes_sent() const { return bytes_sent_; }
  /// Samples, after every action and at every bucket start, the bytes of the gradients alive on this rank
  /// (holders' .grad, ZeRO-2 shards, buffers in flight): gradient_peak_bytes() is then the last step's maximum.
  void track_gradient_peak(bool on) { track_peak_ = on; }
  std::int64_t gradient_peak_bytes() const { return gradient_peak_; }
  /// Whether a stage's buckets start inside the action stream on a blocking transport (ZeRO-2 only): the Pipeline
  /// then shows the collective on the status board before after_action(index) runs it.
  bool blocking_start_after(std::size_t index) const {
    return sharded_ && blocking_starts_ && last_weight_action_.count(index) != 0;
  }

 private:
  struct Bucket {
    int stage = 0;                   // the chunk whose last weight action starts it
    std::vector<at::Tensor> params;  // the gradient holders (see GradientHolder); one dtype and device
    std::int64_t numel = 0;          // of the gradients (the flat buffer has params.size() more: the flags)
    // ZeRO-2 only:
    at::Tensor flat;                 // the holders' values; each holder is a view of it
    ShardRange range;                // this replica's
    at::Tensor shard;                // flat[range], the optimizer's tensor; .grad the averaged shard gradient
  };
  struct InFlight {
    std::size_t bucket = 0;
    at::Tensor flat;
    std::unique_ptr<Work> work;
    at::Tensor out;                  // ZeRO-2: this replica's summed shard
    std::vector<double> defined;     // ZeRO-2: this replica's flags (1: its gradient was defined)
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

  /// ZeRO-2: makes every bucket's holders views of one flat buffer and takes this replica's shard of it.
  void lay_out_flat();
  void start_sharded(std::size_t index, InFlight& f);
  /// ZeRO-2 finish: the shards' means into their .grad; UsageError for a parameter no replica gave a gradient.
  void finish_sharded();

  int rank_;
  bool sharded_ = false;
  bool blocking_starts_ = false;  // ZeRO-2 on a blocking transport: buckets start after their stage's last W/B
  std::int64_t bytes_sent_ = 0;
  bool track_peak_ = false;
  std::int64_t gradient_peak_ = 0;
  void sample_gradient_bytes(std::int64_t extra);
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
