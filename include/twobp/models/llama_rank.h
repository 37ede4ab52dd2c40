#pragma once
// One pipeline rank of a LLaMa-like model (twobp/models/llama.h): its chunks built from a seed, computing on a
// device of their own, wired into a Pipeline with the loss, the boundaries and the precision the model needs.
//
//   models::LlamaRankOptions o{config, partition, seed};  o.micro_batch_size = 2;  o.seq_len = 256;
//   PipelineOptions po;  po.executor.timeout = ...;         // the run's own settings
//   models::LlamaRank rank = models::build_llama_rank(schedule, transport, o, po);
//   rank.pipeline->step(inputs, targets);

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "twobp/models/llama.h"
#include "twobp/precision.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/schedule.h"

namespace twobp::models {

struct LlamaRankOptions {
  LlamaConfig config;
  Partition partition;  ///< one chunk per stage of the schedule
  uint64_t seed = 0;    ///< the chunks' weights (LlamaChunk: the same per global layer whatever the partition)
  int64_t micro_batch_size = 1;
  int64_t seq_len = 0;  ///< > 0
  /// The chunks compute in compute_dtype(precision); kMixedBFloat16: built in float32, the Pipeline keeps float32
  /// masters (PipelineOptions::mixed_precision).
  Precision precision = Precision::kFloat32;
  /// Packed documents: positions and document ids cross every boundary beside the hidden state, the loss masked
  /// (masked_cross_entropy_loss); inputs are packed_inputs / packed_targets.
  bool pack = false;
  /// Every step has micro_batch_size × seq_len tokens: every boundary gets a spec. false (e.g. a sequence-length
  /// warm-up): the senders announce the shapes.
  bool fixed_shapes = true;
  c10::Device device = c10::Device(c10::kCPU);  ///< where the chunks compute (activations travel on the transport's)
  bool recompute = false;  ///< every chunk of this rank recomputes its activations
  /// What a step optimises. kMeanOverItems (the default since 0.3): the token mean over the global batch -- every
  /// target token (with `pack`, every one whose loss_mask is 1) weighs the same however the batch is cut into
  /// micro-batches and replicas; the loss is a micro-batch's summed cross entropy and PipelineOptions::loss_items
  /// counts its tokens. kMeanOfMicroBatches: the mean of the micro-batches' token means (0.2's loss), the same
  /// without `pack` (every micro-batch holds micro_batch_size x seq_len tokens), not with packed documents.
  LossReduction loss_reduction = LossReduction::kMeanOverItems;
};

struct LlamaRank {
  std::unique_ptr<Pipeline> pipeline;
  /// The chunks' tensors by checkpoint name (twobp/checkpoint.h's NamedTensors), the float32 masters under mixed
  /// precision: what an optimizer steps and a checkpoint holds.
  std::vector<std::pair<std::string, at::Tensor>> named;
};

/// This rank's chunks of `schedule` (stages_of(transport.rank())), built on options.device, in a Pipeline over
/// `transport` (borrowed: it must outlive the pipeline) with `base`'s options plus the loss and its reduction
/// (LlamaRankOptions::loss_reduction, replacing base's loss, loss_reduction and loss_items), the boundary specs and
/// the mixed precision the model needs. Throws UsageError when the partition is not one chunk per stage.
LlamaRank build_llama_rank(const Schedule& schedule, Transport& transport, const LlamaRankOptions& options,
                           PipelineOptions base);

/// One rank's model inputs and targets for rows [first_row, first_row + rows) of a global batch (`inputs`, `targets`:
/// [sequences, tokens], the targets the inputs shifted by one), their first `len` tokens: the inputs where the rank
/// holds the first stage (`first`), the targets where it holds the last (`last`), empty elsewhere. With `pack`
/// (LlamaRankOptions::pack): packed_inputs / packed_targets, documents ending at token `separator`.
struct LlamaRankBatch {
  NamedTensors inputs, targets;
};
LlamaRankBatch llama_rank_batch(const at::Tensor& inputs, const at::Tensor& targets, int64_t first_row, int64_t rows,
                                int64_t len, bool first, bool last, bool pack, int64_t separator);

}  // namespace twobp::models
