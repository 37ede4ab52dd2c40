// The LLaMa memory estimates (twobp/models/llama.h) against what a 2BP Stage actually keeps, measured with the CPU
// allocation counter, and the properties of the per-rank plan the example's --dry-run prints.
// A process of its own: it installs the counter (twobp::memory::count_cpu_allocations).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/metrics/memory.h"
#include "twobp/models/llama.h"
#include "twobp/plan/recompute.h"
#include "twobp/schedule/registry.h"
#include "twobp/stage.h"

namespace twobp::testing {
namespace {

namespace llm = twobp::models;
const c10::Device kCpu(c10::DeviceType::CPU);

int64_t now() { return memory::allocated(kCpu).current; }

struct Kept {
  double after_forward = 0;  // what F keeps (its output dropped)
  double after_input = 0;    // what I keeps until W (its input gradient dropped)
  double after_weight = 0;   // what W leaves (its gradients excluded)
};

// Runs F, I, W of one micro-batch of `spec` in a 2BP Stage and measures what each leaves allocated.
Kept measure_chunk(const llm::LlamaConfig& c, const llm::ChunkSpec& spec, int64_t batch, int64_t seq) {
  memory::count_cpu_allocations();
  llm::LlamaChunk chunk(c, spec, 1);
  auto module = chunk.ptr();
  StageOptions o;
  o.stage_index = spec.has_embedding ? 0 : 1;
  o.num_stages = spec.has_head ? o.stage_index + 1 : o.stage_index + 2;
  if (spec.has_head) o.loss = llm::cross_entropy_loss;
  Stage stage(module, [module](const at::Tensor& x) { return module->forward(x); }, o);
  torch::manual_seed(3);
  at::Tensor input = spec.has_embedding ? torch::randint(0, c.vocab_size, {batch, seq}, torch::kLong)
                                        : torch::randn({batch, seq, c.dim}, torch::requires_grad());
  at::Tensor targets = torch::randint(0, c.vocab_size, {batch, seq}, torch::kLong);
  at::Tensor grad_out = spec.has_head ? at::Tensor() : torch::randn({batch, seq, c.dim});
  Kept k;
  const int64_t start = now();
  {
    at::Tensor out = stage.forward(0, input, targets);
    (void)out;
  }
  k.after_forward = static_cast<double>(now() - start);
  {
    NamedTensors g = spec.has_head ? stage.backward_input(0, NamedTensors{})
                                   : stage.backward_input(0, NamedTensors(grad_out));
    (void)g;
  }
  k.after_input = static_cast<double>(now() - start);
  stage.backward_weight({0});
  double grads = 0;
  for (const auto& p : module->parameters()) {
    if (p.grad().defined()) grads += static_cast<double>(p.grad().numel() * p.grad().element_size());
  }
  k.after_weight = static_cast<double>(now() - start) - grads;
  return k;
}

// The formulas are estimates. Measured on the tiny model (fp32, 2 x 64 tokens): F keeps 0.85 (head chunk) to 0.99
// of chunk_activation_bytes, I keeps 0.95 to 1.00 of chunk_pending_weight_bytes; the test keeps both within 20 %.
TEST(LlamaMemoryEstimate, FormulasMatchWhatAStageKeeps) {
  const auto c = llm::config_by_name("tiny");
  const int64_t batch = 2, seq = 64;
  struct Case {
    const char* name;
    llm::ChunkSpec spec;
  };
  for (const Case& k : {Case{"blocks", {0, 2, false, false}}, Case{"embedding + block", {0, 1, true, false}},
                        Case{"block + head", {3, 4, false, true}}}) {
    SCOPED_TRACE(k.name);
    const Kept m = measure_chunk(c, k.spec, batch, seq);
    const double act = static_cast<double>(llm::chunk_activation_bytes(c, k.spec, batch, seq, 4));
    const double pend = static_cast<double>(llm::chunk_pending_weight_bytes(c, k.spec, batch, seq, 4));
    std::cout << k.name << ": F keeps " << m.after_forward / act << " of the estimate, I " << m.after_input / pend
              << "\n";
    EXPECT_NEAR(m.after_forward / act, 1.0, 0.2) << "F keeps " << m.after_forward << ", estimate " << act;
    EXPECT_NEAR(m.after_input / pend, 1.0, 0.2) << "I keeps " << m.after_input << ", estimate " << pend;
    // I frees what W does not need; the head's I also creates the logits' gradient (vocab wide), which its W keeps
    // -- at the tiny model's sizes more than F's activations (since the rotary tables are cached, not saved).
    const double logits_gradient = k.spec.has_head ? static_cast<double>(batch * seq * c.vocab_size * 4) : 0.0;
    EXPECT_LT(m.after_input - logits_gradient, m.after_forward) << "I frees what W does not need";
    EXPECT_LE(m.after_weight, 0.02 * m.after_forward) << "W leaves nothing of the micro-batch";
  }
}

TEST(LlamaMemoryEstimate, PlanParts) {
  const auto c = llm::config_by_name("small");
  const int p = 4, m = 8;
  llm::MemoryPlanOptions o;
  o.micro_batch_size = 1;
  o.seq_len = 256;
  o.precision = llm::training_precision(Precision::kFloat32);
  const auto partition = llm::make_partition(c, p, o.seq_len);
  const auto standard = make_schedule("1f1b", ScheduleOptions{p, m, 1, BackwardMode::kStandard});
  const auto split = make_schedule("1f1b", ScheduleOptions{p, m, 1, BackwardMode::kSplit});
  const auto fused = llm::estimate_memory(c, partition, standard, o);
  const auto twobp = llm::estimate_memory(c, partition, split, o);
  o.recompute = true;
  const auto recomputed = llm::estimate_memory(c, partition, split, o);
  o.recompute = false;
  o.precision = llm::training_precision(Precision::kMixedBFloat16);
  const auto mixed = llm::estimate_memory(c, partition, split, o);
  for (int r = 0; r < p; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const double n = static_cast<double>(fused[r].parameters);
    EXPECT_EQ(fused[r].parameters, llm::chunk_parameter_count(c, partition.chunks[r]));
    EXPECT_DOUBLE_EQ(fused[r].weights, 4 * n);
    EXPECT_DOUBLE_EQ(fused[r].optimizer, 8 * n);
    EXPECT_DOUBLE_EQ(fused[r].master_weights, 0.0);
    EXPECT_DOUBLE_EQ(fused[r].pending_weights, 0.0);  // no W without 2BP
    EXPECT_GT(twobp[r].pending_weights, 0.0);
    // Everything at once never exceeds the sum of the parts' peaks, and holds at least the state.
    for (const auto* e : {&fused[r], &twobp[r], &recomputed[r], &mixed[r]}) {
      EXPECT_LE(e->total, e->weights + e->master_weights + e->optimizer + e->gradients + e->activations +
                              e->pending_weights + 1.0);
      EXPECT_GE(e->total, e->weights + e->master_weights + e->optimizer);
    }
    // Recomputation keeps inputs instead of activations: less wherever several micro-batches are live.
    EXPECT_LE(recomputed[r].activations, twobp[r].activations);
    if (r == 0) EXPECT_LT(recomputed[r].activations, 0.5 * twobp[r].activations);
    EXPECT_DOUBLE_EQ(mixed[r].weights, 2 * n);
    EXPECT_DOUBLE_EQ(mixed[r].master_weights, 4 * n);
    EXPECT_DOUBLE_EQ(mixed[r].gradients, 4 * n);
    // Activations in bf16: half, but the head's float32 log-softmax (4 bytes per logit whatever the dtype).
    EXPECT_GE(mixed[r].activations, 0.5 * twobp[r].activations);
    EXPECT_LT(mixed[r].activations, 0.6 * twobp[r].activations);
  }
  const llm::TrainingPrecision pure = llm::training_precision(Precision::kBFloat16);
  EXPECT_EQ(pure.precision, Precision::kBFloat16);
  EXPECT_EQ(pure.compute_bytes, 2);
  EXPECT_EQ(pure.master_bytes, 0);
  EXPECT_EQ(pure.gradient_bytes, 2);
}

// MemoryPlanOptions::recompute_ranks: a rank's memory changes only by its own actions, so with any set of ranks
// recomputing each rank's estimate is exactly the all-recomputing one on the ranks of the set and the one without
// on the others -- every set of the 4 ranks, on every placement (one and two stages per rank), in both modes.
TEST(LlamaMemoryEstimate, RecomputeRanksRecomputeOnTheirRanksOnly) {
  const auto c = llm::config_by_name("small");
  const int p = 4;
  llm::MemoryPlanOptions o;
  o.micro_batch_size = 1;
  o.seq_len = 256;
  o.precision = llm::training_precision(Precision::kFloat32);
  for (const auto& [name, v] : std::vector<std::pair<std::string, int>>{{"1f1b", 1}, {"zb-v", 2}}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const auto sc = make_schedule(name, ScheduleOptions{p, 2 * p, v, mode});
      const auto partition = llm::make_partition(c, sc.num_stages, o.seq_len);
      o.recompute = false;
      const auto none = llm::estimate_memory(c, partition, sc, o);
      o.recompute = true;
      o.recompute_ranks.clear();
      const auto all = llm::estimate_memory(c, partition, sc, o);
      for (unsigned set = 1; set < (1u << p); ++set) {
        o.recompute_ranks.clear();
        for (int r = 0; r < p; ++r) {
          if (set & (1u << r)) o.recompute_ranks.push_back(r);
        }
        const auto some = llm::estimate_memory(c, partition, sc, o);
        for (int r = 0; r < p; ++r) {
          const auto& want = (set & (1u << r)) != 0 ? all[r] : none[r];
          const std::string what = name + " ranks " + twobp::format_ranks(o.recompute_ranks) + " rank " +
                                   std::to_string(r);
          EXPECT_DOUBLE_EQ(some[r].total, want.total) << what;
          EXPECT_DOUBLE_EQ(some[r].activations, want.activations) << what;
        }
      }
      EXPECT_LT(all[0].activations, none[0].activations) << name;  // the two differ where it is checked
      o.recompute_ranks.clear();
    }
  }
}

}  // namespace
}  // namespace twobp::testing
