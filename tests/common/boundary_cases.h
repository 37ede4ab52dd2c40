#pragma once
// Stage boundaries of several tensors, shared by the thread and the MPI tests: a model whose boundaries carry
// two differentiable tensors ("h", "r"), a non-differentiable one ("mask", bool), an encoder output relayed
// unchanged through every stage ("enc": an output that is the stage's own input leaf) and, optionally, an
// auxiliary tensor that only odd stages use ("aux": where an even stage receives it, no gradient reaches it, so
// the producer's parameters must end with an *undefined* .grad, as loss.backward() leaves them). The last stage
// gets a side input ("weight") from the targets, in its forward and in its loss. Sequence lengths may differ per
// micro-batch and per step. Float64, compared against one process running the same chunks in a row.

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "common/test_models.h"
#include "twobp/nn.h"
#include "twobp/tensors.h"
#include "twobp/runtime/pipeline.h"

namespace twobp::testing {

constexpr int64_t kBoundaryDim = 4;
constexpr int64_t kBoundaryBatch = 2;  // per micro-batch

struct BoundaryChunkImpl : torch::nn::Module {
  BoundaryChunkImpl(int stage, int num_stages, bool aux) : stage(stage), last(stage == num_stages - 1), aux(aux) {
    // Even stages use the fast path (twobp::nn::Linear), odd ones the general path: both halves of the split.
    auto linear = [&](const char* name) {
      if (stage % 2 == 0) {
        fast.emplace(name, register_module(name, twobp::nn::Linear(kBoundaryDim, kBoundaryDim)));
      } else {
        general.emplace(name, register_module(name, torch::nn::Linear(kBoundaryDim, kBoundaryDim)));
      }
    };
    for (const char* name : {"a", "b"}) linear(name);
    if (stage == 0) linear("e");
    if (aux && !last) linear("c");
  }

  torch::Tensor apply(const std::string& name, const torch::Tensor& x) {
    auto f = fast.find(name);
    return f != fast.end() ? f->second(x) : general.at(name)(x);
  }

  NamedTensors forward(const NamedTensors& in) {
    torch::Tensor h_in, r_in, enc;
    const torch::Tensor& mask = in["mask"];
    if (stage == 0) {
      h_in = in["x"];
      r_in = in["x"] * 0.5;
      enc = torch::tanh(apply("e", in["x"]));
    } else {
      h_in = in["h"];
      r_in = in["r"];
      enc = in["enc"];  // relayed unchanged below: an output that is this stage's input leaf
    }
    const torch::Tensor m = mask.to(h_in.scalar_type()).unsqueeze(-1);
    torch::Tensor h = torch::tanh(apply("a", h_in)) * m + r_in + 0.5 * enc;
    if (aux && stage % 2 == 1) h = h + in["aux"].unsqueeze(1);  // even stages ignore their "aux" input
    torch::Tensor r = apply("b", r_in) * 0.5 + 0.1 * h_in;
    if (last) return NamedTensors{{"out", (h + r) * (1.0 + in["weight"].unsqueeze(-1))}};
    NamedTensors out{{"h", h}, {"r", r}, {"mask", mask}, {"enc", enc}};
    if (aux) out.add("aux", apply("c", h_in.mean(1)));
    return out;
  }

  int stage;
  bool last, aux;
  std::map<std::string, twobp::nn::Linear> fast;
  std::map<std::string, torch::nn::Linear> general;
};
TORCH_MODULE(BoundaryChunk);

inline BoundaryChunk make_boundary_chunk(int stage, int num_stages, bool aux) {
  torch::manual_seed(300 + stage);
  return BoundaryChunk(stage, num_stages, aux);
}

inline at::Tensor boundary_loss(const NamedTensors& outputs, const NamedTensors& targets) {
  return ((outputs["out"] - targets["y"]).pow(2) * (1.0 + targets["weight"]).unsqueeze(-1)).mean();
}

/// One step's data, micro-batch by micro-batch.
struct BoundaryBatch {
  std::vector<NamedTensors> inputs, targets;
};

/// `lengths[k]`: the sequence length of micro-batch k.
inline BoundaryBatch make_boundary_batch(const std::vector<int64_t>& lengths, int seed) {
  torch::manual_seed(seed);
  BoundaryBatch b;
  for (int64_t t : lengths) {
    b.inputs.push_back(NamedTensors{{"x", torch::randn({kBoundaryBatch, t, kBoundaryDim}, torch::kDouble)},
                                    {"mask", torch::rand({kBoundaryBatch, t}) > 0.3}});
    b.targets.push_back(NamedTensors{{"y", torch::randn({kBoundaryBatch, t, kBoundaryDim}, torch::kDouble)},
                                     {"weight", torch::rand({kBoundaryBatch, t}, torch::kDouble)}});
  }
  return b;
}

/// Every step's micro-batch lengths: different per micro-batch and per step when `variable`, else all 3.
inline std::vector<std::vector<int64_t>> boundary_lengths(int steps, int micro_batches, bool variable) {
  std::vector<std::vector<int64_t>> out(steps);
  for (int i = 0; i < steps; ++i) {
    for (int k = 0; k < micro_batches; ++k) out[i].push_back(variable ? 1 + (k + 2 * i) % 4 : 3);
  }
  return out;
}

/// The boundaries' fixed specs (every micro-batch of length 3); "aux" only when the model has it.
inline BoundarySpec boundary_spec(bool aux) {
  const auto d = at::kDouble;
  BoundarySpec spec{{{kBoundaryBatch, 3, kBoundaryDim}, d, "h"},
                    {{kBoundaryBatch, 3, kBoundaryDim}, d, "r"},
                    {{kBoundaryBatch, 3}, at::kBool, "mask", false},
                    {{kBoundaryBatch, 3, kBoundaryDim}, d, "enc"}};
  if (aux) spec.push_back({{kBoundaryBatch, kBoundaryDim}, d, "aux"});
  return spec;
}

/// The single-process reference: every step's micro-batches through all chunks in a row, loss.backward() on the
/// mean over each step's micro-batches. Returns the chunks (with their .grad) and every step's losses.
struct BoundaryReference {
  std::vector<BoundaryChunk> chunks;
  std::vector<std::vector<double>> losses;  // [step][micro-batch]
};

inline BoundaryReference run_boundary_reference(int num_stages, bool aux, const std::vector<BoundaryBatch>& steps) {
  BoundaryReference ref;
  for (int s = 0; s < num_stages; ++s) ref.chunks.push_back(make_boundary_chunk(s, num_stages, aux));
  for (const auto& batch : steps) {
    const int m = static_cast<int>(batch.inputs.size());
    ref.losses.emplace_back();
    for (int k = 0; k < m; ++k) {
      NamedTensors cur = batch.inputs[k];
      for (int s = 0; s < num_stages; ++s) {
        if (s == num_stages - 1) {
          for (const auto& [name, t] : batch.targets[k]) cur.add(name, t);
        }
        cur = ref.chunks[s]->forward(cur);
      }
      const at::Tensor loss = boundary_loss(cur, batch.targets[k]);
      (loss / m).backward();
      ref.losses.back().push_back(loss.item<double>());
    }
  }
  return ref;
}

/// Empty when `got` matches the reference chunk's gradients (defined exactly where the reference's are, equal
/// within `tolerance`), else what differs.
inline std::string compare_gradients(torch::nn::Module& got, torch::nn::Module& want, int stage,
                                     double tolerance = 1e-12) {
  std::string out;
  auto mine = got.named_parameters();
  for (const auto& item : want.named_parameters()) {
    const at::Tensor& g = mine[item.key()].grad();
    const at::Tensor& w = item.value().grad();
    const std::string where = "stage " + std::to_string(stage) + " " + item.key();
    if (g.defined() != w.defined()) {
      out += where + ": gradient " + (g.defined() ? "defined" : "undefined") + ", reference " +
             (w.defined() ? "defined" : "undefined") + "\n";
    } else if (g.defined()) {
      const double diff = (g - w).abs().max().item<double>();
      if (!(diff <= tolerance)) out += where + ": differs by " + std::to_string(diff) + "\n";
    }
  }
  return out;
}

/// The chunks of `rank` and its PipelineChunk list for `schedule`.
inline std::vector<PipelineChunk> boundary_chunks(const Schedule& schedule, int rank, bool aux,
                                                  std::map<int, BoundaryChunk>* modules, bool recompute = false) {
  std::vector<PipelineChunk> chunks;
  for (int s : schedule.stages_of(rank)) {
    BoundaryChunk module = make_boundary_chunk(s, schedule.num_stages, aux);
    modules->emplace(s, module);
    auto* raw = module.get();
    chunks.push_back({s, module.ptr(), [raw](const NamedTensors& in) { return raw->forward(in); }, recompute});
  }
  return chunks;
}

}  // namespace twobp::testing
