#include "twobp/models/llama_rank.h"

#include <ATen/ATen.h>

#include "twobp/checkpoint.h"
#include "twobp/error.h"
#include "util/check.h"

namespace twobp::models {

namespace {

// Stage `s` computing on `device`, its activations travelling on `wire` (the last stage's logits stay).
PipelineChunk make_chunk(const std::shared_ptr<LlamaChunkImpl>& impl, int s, bool is_last, bool pack,
                         c10::Device device, c10::Device wire) {
  if (pack) {
    return {s, impl, [impl, device, wire, is_last](const NamedTensors& in) {
              NamedTensors here;
              for (const auto& [name, t] : in) here.add(name, t.to(device));
              NamedTensors out = impl->forward(here);
              if (!is_last) {
                for (auto& e : out) e.tensor = e.tensor.to(wire);
              }
              return out;
            }};
  }
  return {s, impl, [impl, device, wire, is_last](const at::Tensor& x) {
            at::Tensor y = impl->forward(x.to(device));
            return is_last ? y : y.to(wire);
          }};
}

// The loss, how micro-batches' losses combine (LlamaRankOptions::loss_reduction), and the items counted: every
// target token, or with packing the ones whose loss_mask is 1 (packed_targets: not the separators').
void set_loss(PipelineOptions& po, const LlamaRankOptions& o) {
  po.loss_reduction = o.loss_reduction;
  if (o.loss_reduction == LossReduction::kMeanOverItems) {
    if (o.pack) {
      po.loss = summed_masked_cross_entropy_loss;
      po.loss_items = [](const NamedTensors& t) { return t[kLossMask].sum().item<double>(); };
    } else {
      po.loss = summed_cross_entropy_loss;
      po.loss_items = [](const NamedTensors& t) { return static_cast<double>(t.single("targets").numel()); };
    }
  } else if (o.pack) {
    po.loss = masked_cross_entropy_loss;
  } else {
    po.loss = [](const at::Tensor& logits, const at::Tensor& targets) {
      return models::cross_entropy_loss(logits, targets.to(logits.device()));
    };
  }
}

// The loss and, with fixed shapes, every boundary's spec.
void complete_options(PipelineOptions& po, const LlamaRankOptions& o) {
  const int64_t mbs = o.micro_batch_size, seq = o.seq_len, dim = o.config.dim;
  const auto dtype = compute_dtype(o.precision);
  if (o.fixed_shapes && o.pack) {
    po.executor.boundary_spec = [=](int) {
      return BoundarySpec{{{mbs, seq, dim}, dtype, kHidden},
                          {{mbs, seq}, at::kLong, kPositions, false},
                          {{mbs, seq}, at::kLong, kDocIds, false}};
    };
  } else if (o.fixed_shapes) {
    po.executor.activation_spec = [=](int) { return TensorSpec{{mbs, seq, dim}, dtype}; };
  }
  set_loss(po, o);
  if (o.precision == Precision::kMixedBFloat16) po.mixed_precision.compute_dtype = at::kBFloat16;
}

}  // namespace

LlamaRank build_llama_rank(const Schedule& schedule, Transport& transport, const LlamaRankOptions& options,
                           PipelineOptions base) {
  TWOBP_CHECK(static_cast<int>(options.partition.chunks.size()) == schedule.num_stages && options.seq_len > 0,
              UsageError, "build_llama_rank: a partition of {} chunks for schedule '{}' of {} stages (seq_len {})",
              options.partition.chunks.size(), schedule.name, schedule.num_stages, options.seq_len);
  LlamaRank rank;
  std::vector<PipelineChunk> chunks;
  // Mixed precision: built in float32; the Pipeline keeps float32 masters and converts the chunk to bfloat16.
  const bool masters = options.precision == Precision::kMixedBFloat16;
  for (int s : schedule.stages_of(transport.rank())) {
    LlamaChunk chunk(options.config, options.partition.chunks[s], options.seed);
    chunk->to(options.device, masters ? at::kFloat : compute_dtype(options.precision));
    for (auto& t : checkpoint::module_tensors(*chunk)) rank.named.push_back(t);
    chunks.push_back(make_chunk(chunk.ptr(), s, s == schedule.num_stages - 1, options.pack, options.device,
                                transport.device()));
    chunks.back().recompute = options.recompute;
  }
  complete_options(base, options);
  if (options.config.tie_embeddings && schedule.num_stages > 1) {
    // The embedding (stage 0) and the head (last stage) are copies of one table (LlamaConfig::tie_embeddings).
    base.tied_parameters.push_back(
        TiedParameter{"the tied embedding", {{0, "embed.weight"}, {schedule.num_stages - 1, "head.weight"}}});
  }
  rank.pipeline = std::make_unique<Pipeline>(schedule, std::move(chunks), transport, std::move(base));
  // With mixed precision the optimizer and the checkpoints hold the float32 masters.
  for (auto& entry : rank.named) entry.second = rank.pipeline->master_weight(entry.second);
  return rank;
}

LlamaRankBatch llama_rank_batch(const at::Tensor& inputs, const at::Tensor& targets, int64_t first_row, int64_t rows,
                                int64_t len, bool first, bool last, bool pack, int64_t separator) {
  const at::Tensor ids = inputs.narrow(0, first_row, rows).narrow(1, 0, len);
  const at::Tensor next = targets.narrow(0, first_row, rows).narrow(1, 0, len);
  LlamaRankBatch out;
  if (first) out.inputs = pack ? packed_inputs(ids, separator) : NamedTensors(ids);
  if (last) out.targets = pack ? packed_targets(ids, next, separator) : NamedTensors(next);
  return out;
}

}  // namespace twobp::models
