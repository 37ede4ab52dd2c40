// Planning a LLaMa-like stack (twobp/plan/llama.h): made-up affine chunk costs are fitted back exactly, one chunk
// shape falls back to FLOP shares, costs carry to other shapes by FLOPs, and the ranked layouts are the simulator's
// predictions in the promised order, filtered by memory.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/models/llama.h"
#include "twobp/plan/llama.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"

namespace twobp {
namespace {

namespace llm = models;

// Terms that differ per action type and per term, so that a term or type mixed up shows.
const ChunkCost kF{0.25, 1.5, 0.75, 3.0};
const ChunkCost kI{0.125, 1.75, 0.5, 2.5};
const ChunkCost kW{0.375, 1.25, 0.0625, 4.0};
const ChunkCost kB{0.5, 3.5, 0.625, 6.25};
const ChunkCost kW0{0.875, 0.3125, 0.25, 0.5};  // the fixed part of every W

llm::LlamaConfig model() { return llm::config_by_name("small"); }
constexpr int64_t kSeq = 64;

// A run of `chunks` chunks in `mode` whose measured costs are exactly the made-up ones; with `fixed_w`, its W's
// also showed a fixed part (kW0: MeasuredCosts::backward_weight_fixed).
MeasuredLlamaRun exact_run(int chunks, BackwardMode mode, bool fixed_w = false) {
  MeasuredLlamaRun run;
  run.partition = llm::make_partition(model(), chunks, kSeq);
  run.mode = mode;
  for (const llm::ChunkSpec& c : run.partition.chunks) {
    const bool split = mode == BackwardMode::kSplit;
    run.costs.forward.push_back(kF.of(c));
    run.costs.backward_input.push_back(split ? kI.of(c) : 0.0);
    run.costs.backward_weight.push_back(split ? kW.of(c) : 0.0);
    run.costs.backward.push_back(split ? 0.0 : kB.of(c));
    if (fixed_w && split) run.costs.backward_weight_fixed.push_back(kW0.of(c));
  }
  return run;
}

void expect_terms(const ChunkCost& got, const ChunkCost& want, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_NEAR(got.per_action, want.per_action, 1e-9);
  EXPECT_NEAR(got.per_block, want.per_block, 1e-9);
  EXPECT_NEAR(got.embedding, want.embedding, 1e-9);
  EXPECT_NEAR(got.head, want.head, 1e-9);
}

TEST(FitLlamaCosts, RecoversMadeUpAffineCostsFromTwoChunkShapes) {
  const std::vector<MeasuredLlamaRun> runs{exact_run(2, BackwardMode::kSplit), exact_run(4, BackwardMode::kSplit),
                                           exact_run(2, BackwardMode::kStandard),
                                           exact_run(3, BackwardMode::kStandard)};
  const LlamaCosts c = fit_llama_costs(model(), kSeq, runs);
  ASSERT_EQ(c.kind, LlamaCosts::Kind::kFitted) << c.how;
  expect_terms(c.forward, kF, "F");
  expect_terms(c.backward_input, kI, "I");
  expect_terms(c.backward_weight, kW, "W");
  expect_terms(c.backward, kB, "B");
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_STREQ(llama_costs_kind_name(c.kind), "fitted");
}

// A run document of the model (as `twobp_bench pipeline --json` writes one): the same fit from its plain results,
// whatever order they come in; a result measured under a memory limit is left out; the message time per byte of
// the first 2BP result's float32 activation.
TEST(FitRunDocument, FitsThePlainResultsOfTheDocumentsModel) {
  const llm::LlamaConfig m = model();
  RunDocument doc;
  doc.model = {"llama", m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size, kSeq, 1};
  auto add = [&](int p, int v, BackwardMode mode, double comm, int64_t limit) {
    RunRecord r;
    r.schedule = v == 1 ? "1f1b" : "interleaved-1f1b";
    r.mode = mode;
    r.p = p;
    r.v = v;
    r.m = 4;
    r.memory_limit_bytes = limit;
    r.costs = exact_run(p * v, mode).costs;
    r.costs.communication = comm;
    if (limit > 0) r.costs.forward.assign(r.costs.forward.size(), 1000.0);  // would spoil the fit if used
    doc.results.push_back(r);
  };
  add(3, 1, BackwardMode::kStandard, 9.0, 0);
  add(2, 1, BackwardMode::kSplit, 0.5, 0);
  add(2, 1, BackwardMode::kSplit, 7.0, 1 << 20);
  add(2, 2, BackwardMode::kSplit, 0.75, 0);
  add(2, 1, BackwardMode::kStandard, 9.0, 0);
  EXPECT_EQ(measured_llama_config(doc, "d.json").name, "measured");
  EXPECT_EQ(measured_llama_config(doc, "d.json").dim, m.dim);
  const DocumentCosts fit = fit_run_document(doc, "d.json", m, kSeq, 1);
  ASSERT_EQ(fit.costs.kind, LlamaCosts::Kind::kFitted) << fit.costs.how;
  expect_terms(fit.costs.forward, kF, "F");
  expect_terms(fit.costs.backward_input, kI, "I");
  expect_terms(fit.costs.backward_weight, kW, "W");
  expect_terms(fit.costs.backward, kB, "B");
  EXPECT_DOUBLE_EQ(fit.comm_ms_per_byte, 0.5 / static_cast<double>(kSeq * m.dim * 4));
  EXPECT_EQ(fit.used, (std::vector<std::string>{"1f1b standard p=3 v=1", "1f1b 2bp p=2 v=1",
                                                "interleaved-1f1b 2bp p=2 v=2", "1f1b standard p=2 v=1"}));

  RunDocument costs_only = doc;
  costs_only.model.model = "";
  RunDocument resnet = doc;
  resnet.model.model = "resnet";
  RunDocument standard_only = doc;
  standard_only.results = {doc.results[0], doc.results[4]};
  for (const auto& [d, says] : std::vector<std::pair<RunDocument, std::string>>{
           {costs_only, "no \"config\""}, {resnet, "LLaMa-like"}, {standard_only, "no 2bp result"}}) {
    try {
      fit_run_document(d, "d.json", m, kSeq, 1);
      ADD_FAILURE() << "accepted a document with " << says;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("d.json"), std::string::npos) << e.what();
    }
  }
}

TEST(FitLlamaCosts, WithoutAStandardRunBIsIPlusW) {
  const LlamaCosts c =
      fit_llama_costs(model(), kSeq, {exact_run(2, BackwardMode::kSplit), exact_run(4, BackwardMode::kSplit)});
  ASSERT_EQ(c.kind, LlamaCosts::Kind::kFitted);
  expect_terms(c.backward, kI + kW, "B = I + W");
}

// W's measured in two sizes give a fixed part (W0 + k W): fitted back as its own terms, not folded into W, so that
// the planner charges a batched W of k micro-batches W0 + k W as the simulator fed from the run would; a fused B
// without a standard run is I + W0 + W. Runs whose W's had one size only leave it zero (and CostModel without it).
TEST(FitLlamaCosts, AFixedWPartIsFittedAndPlanned) {
  const LlamaCosts c = fit_llama_costs(
      model(), kSeq, {exact_run(2, BackwardMode::kSplit, true), exact_run(4, BackwardMode::kSplit, true)});
  ASSERT_EQ(c.kind, LlamaCosts::Kind::kFitted) << c.how;
  expect_terms(c.backward_weight, kW, "W");
  expect_terms(c.backward_weight_fixed, kW0, "W0");
  expect_terms(c.backward, kI + kW0 + kW, "B = I + W0 + W");
  EXPECT_NE(c.how.find("per W"), std::string::npos) << c.how;
  const llm::Partition partition = llm::make_partition(model(), 3, kSeq);
  const CostModel split = c.cost_model(partition, BackwardMode::kSplit, false, 0.0);
  ASSERT_EQ(split.backward_weight_fixed.size(), partition.chunks.size());
  for (std::size_t s = 0; s < partition.chunks.size(); ++s) {
    EXPECT_NEAR(split.backward_weight_fixed[s], kW0.of(partition.chunks[s]), 1e-9) << "stage " << s;
    EXPECT_NEAR(split.weight(static_cast<int>(s), 4), kW0.of(partition.chunks[s]) + 4 * kW.of(partition.chunks[s]),
                1e-9)
        << "stage " << s;
  }
  EXPECT_TRUE(c.cost_model(partition, BackwardMode::kStandard, false, 0.0).backward_weight_fixed.empty());
  // Carried to another shape: the fixed part is not the micro-batches' work, so it stays.
  expect_terms(c.carried(model(), kSeq, 1, model(), 2 * kSeq, 4).backward_weight_fixed, kW0, "W0 carried");

  const LlamaCosts none =
      fit_llama_costs(model(), kSeq, {exact_run(2, BackwardMode::kSplit), exact_run(4, BackwardMode::kSplit)});
  EXPECT_TRUE(none.backward_weight_fixed.is_zero());
  EXPECT_TRUE(none.cost_model(partition, BackwardMode::kSplit, false, 0.0).backward_weight_fixed.empty());
}

TEST(FitLlamaCosts, OneChunkShapeFallsBackToFlopShares) {
  // Two chunks: one row with the embedding, one with the head: the four terms are not determined.
  const MeasuredLlamaRun split = exact_run(2, BackwardMode::kSplit);
  const MeasuredLlamaRun standard = exact_run(2, BackwardMode::kStandard);
  const LlamaCosts c = fit_llama_costs(model(), kSeq, {split, standard});
  ASSERT_EQ(c.kind, LlamaCosts::Kind::kFlopShares);
  auto sum = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s;
  };
  double units = 0;
  for (double u : split.partition.cost) units += u;
  const double f_split = sum(split.costs.forward), f_standard = sum(standard.costs.forward);
  // Both runs' F over both partitions' cost units.
  EXPECT_NEAR(c.forward.per_block, (f_split + f_standard) / (2 * units), 1e-12);
  EXPECT_NEAR(c.forward.head, llm::head_cost_in_blocks(model(), kSeq) * c.forward.per_block, 1e-12);
  EXPECT_EQ(c.forward.per_action, 0.0);
  EXPECT_EQ(c.forward.embedding, 0.0);
  EXPECT_NEAR(c.backward_input.per_block / c.forward.per_block, sum(split.costs.backward_input) / f_split, 1e-12);
  EXPECT_NEAR(c.backward_weight.per_block / c.forward.per_block, sum(split.costs.backward_weight) / f_split, 1e-12);
  EXPECT_NEAR(c.backward.per_block / c.forward.per_block, sum(standard.costs.backward) / f_standard, 1e-12);
  EXPECT_TRUE(c.backward_weight_fixed.is_zero());

  // A fixed W part at its summed ratio to F too, and in B = I + W0 + W without a standard run.
  const MeasuredLlamaRun fixed = exact_run(2, BackwardMode::kSplit, true);
  const LlamaCosts w0 = fit_llama_costs(model(), kSeq, {fixed});
  ASSERT_EQ(w0.kind, LlamaCosts::Kind::kFlopShares);
  const double f_fixed = sum(fixed.costs.forward);
  EXPECT_NEAR(w0.backward_weight_fixed.per_block / w0.forward.per_block,
              sum(fixed.costs.backward_weight_fixed) / f_fixed, 1e-12);
  EXPECT_NEAR(w0.backward.per_block / w0.forward.per_block,
              (sum(fixed.costs.backward_input) + sum(fixed.costs.backward_weight_fixed) +
               sum(fixed.costs.backward_weight)) / f_fixed,
              1e-12);
}

// Issue 70: a per-action cost measured elsewhere, with one chunk shape: taken out of every measured action before the
// FLOP shares and put back as each F, I, B and W0's per-action term -- the measured partition's totals kept, a
// partition of more chunks paying it more often. Where the shapes fit the term themselves it is refused.
TEST(FitLlamaCosts, AGivenPerActionCostIsTakenOutOfOneShapeAndRefusedWhereShapesFitIt) {
  const MeasuredLlamaRun split = exact_run(2, BackwardMode::kSplit);
  const MeasuredLlamaRun standard = exact_run(2, BackwardMode::kStandard);
  const double x = 0.0625;
  const LlamaCosts c = fit_llama_costs(model(), kSeq, {split, standard}, x);
  ASSERT_EQ(c.kind, LlamaCosts::Kind::kFlopShares);
  for (const ChunkCost* k : {&c.forward, &c.backward_input, &c.backward, &c.backward_weight_fixed}) {
    EXPECT_EQ(k->per_action, x);
  }
  EXPECT_EQ(c.backward_weight.per_action, 0.0) << "W per micro-batch: its W0 pays the action's fixed cost";
  EXPECT_NE(c.how.find("0.0625 ms per action"), std::string::npos) << c.how;
  auto sum = [](const std::vector<double>& v) {
    double s = 0;
    for (double t : v) s += t;
    return s;
  };
  auto total = [](const ChunkCost& k, const llm::Partition& p) {
    double s = 0;
    for (const llm::ChunkSpec& chunk : p.chunks) s += k.of(chunk);
    return s;
  };
  const llm::Partition& two = split.partition;
  EXPECT_NEAR(total(c.forward, two), sum(split.costs.forward), 1e-9);
  EXPECT_NEAR(total(c.backward_input, two), sum(split.costs.backward_input), 1e-9);
  EXPECT_NEAR(total(c.backward_weight_fixed, two) + total(c.backward_weight, two), sum(split.costs.backward_weight),
              1e-9);
  EXPECT_NEAR(total(c.backward, two), sum(standard.costs.backward), 1e-9);
  const llm::Partition four = llm::make_partition(model(), 4, kSeq);
  EXPECT_NEAR(total(c.forward, four) - total(c.forward, two), 2 * x, 1e-9) << "two more chunks, two more F's";
  // The planner's cost model charges it in every stage's costs, and a W's fixed part once per W.
  const CostModel m = c.cost_model(four, BackwardMode::kSplit, false, 0.0);
  ASSERT_EQ(m.backward_weight_fixed.size(), 4u);
  EXPECT_DOUBLE_EQ(m.backward_weight_fixed[0], x);
  EXPECT_EQ(m.per_action, 0.0) << "one value: in the stages' costs, not again in CostModel::per_action";
  // 0 given: as none given.
  const LlamaCosts none = fit_llama_costs(model(), kSeq, {split, standard});
  const LlamaCosts zero = fit_llama_costs(model(), kSeq, {split, standard}, 0.0);
  expect_terms(zero.forward, none.forward, "F at 0");
  expect_terms(zero.backward, none.backward, "B at 0");
  // Two shapes fit the per-action terms: a given one would be a second value.
  const std::vector<MeasuredLlamaRun> shapes{split, exact_run(4, BackwardMode::kSplit)};
  EXPECT_NO_THROW(fit_llama_costs(model(), kSeq, shapes));
  for (double given : {0.0, x}) {
    try {
      fit_llama_costs(model(), kSeq, shapes, given);
      ADD_FAILURE() << given << " ms per action was taken beside the fitted term";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("determine the per-action terms themselves"), std::string::npos)
          << e.what();
    }
  }
  // More than the actions measured, or not a time: refused.
  EXPECT_THROW(fit_llama_costs(model(), kSeq, {split, standard}, 1e6), UsageError);
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0}) {
    EXPECT_THROW(fit_llama_costs(model(), kSeq, {split, standard}, bad), UsageError) << bad;
    EXPECT_THROW(estimate_llama_costs(model(), kSeq, 1, 50.0, measured_backward_ratios(), bad), UsageError) << bad;
  }
  // Estimated costs: on top of the FLOP time.
  const LlamaCosts flops = estimate_llama_costs(model(), kSeq, 1, 50.0);
  const LlamaCosts fixed = estimate_llama_costs(model(), kSeq, 1, 50.0, measured_backward_ratios(), x);
  const llm::ChunkSpec& first = four.chunks[0];
  EXPECT_NEAR(fixed.forward.of(first), flops.forward.of(first) + x, 1e-12);
  EXPECT_NEAR(fixed.backward.of(first), flops.backward.of(first) + x, 1e-12);
  EXPECT_NEAR(fixed.backward_weight.of(first), flops.backward_weight.of(first), 1e-12);
  EXPECT_EQ(fixed.backward_weight_fixed.per_action, x);
  EXPECT_NE(fixed.how.find("0.0625 ms per action"), std::string::npos) << fixed.how;
}

TEST(FitLlamaCosts, NegativeTermsWarnAndBadRunsAreRefused) {
  MeasuredLlamaRun a = exact_run(2, BackwardMode::kSplit), b = exact_run(4, BackwardMode::kSplit);
  for (MeasuredLlamaRun* r : {&a, &b}) {  // W with a negative per-action term
    for (double& w : r->costs.backward_weight) w -= 2.0;
  }
  const LlamaCosts c = fit_llama_costs(model(), kSeq, {a, b});
  ASSERT_EQ(c.kind, LlamaCosts::Kind::kFitted);
  ASSERT_FALSE(c.warnings.empty());
  EXPECT_NE(c.warnings.front().find("W cost per action is negative"), std::string::npos) << c.warnings.front();

  EXPECT_THROW(fit_llama_costs(model(), kSeq, {exact_run(2, BackwardMode::kStandard)}), UsageError);  // no I, W
  MeasuredLlamaRun short_run = exact_run(4, BackwardMode::kSplit);
  short_run.costs.forward.pop_back();
  EXPECT_THROW(fit_llama_costs(model(), kSeq, {short_run}), UsageError);
}

TEST(LlamaCosts, CarriedScalesBlocksAndHeadByFlopsEmbeddingByElementsPerActionNot) {
  LlamaCosts c;
  c.forward = kF;
  c.backward_input = kI;
  c.backward_weight = kW;
  c.backward = kB;
  const llm::LlamaConfig from = model(), to = llm::config_by_name("1b");
  const LlamaCosts same = c.carried(from, kSeq, 2, from, kSeq, 2);
  expect_terms(same.backward, kB, "identity");
  const LlamaCosts other = c.carried(from, kSeq, 2, to, 4 * kSeq, 3);
  const double batch = 1.5;
  EXPECT_NEAR(other.forward.per_block,
              kF.per_block * batch * llm::block_forward_flops(to, 4 * kSeq) / llm::block_forward_flops(from, kSeq),
              1e-9 * other.forward.per_block);
  EXPECT_NEAR(other.backward_weight.head,
              kW.head * batch * llm::head_forward_flops(to, 4 * kSeq) / llm::head_forward_flops(from, kSeq),
              1e-9 * other.backward_weight.head);
  EXPECT_NEAR(other.backward_input.embedding, kI.embedding * batch * 4.0 * static_cast<double>(to.dim) / from.dim,
              1e-12);
  EXPECT_EQ(other.backward.per_action, kB.per_action);
  EXPECT_THROW(c.carried(from, 0, 1, to, kSeq, 1), UsageError);
}

TEST(LlamaCosts, CostModelIsEachChunksCostInTheModesTerms) {
  LlamaCosts c;
  c.forward = kF;
  c.backward_input = kI;
  c.backward_weight = {-100.0, 0.0, 0.0, 0.0};  // negative everywhere: clamped, no action is free
  c.backward = kB;
  const llm::Partition part = llm::make_partition(model(), 3, kSeq);
  for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
    for (bool recompute : {false, true}) {
      const CostModel m = c.cost_model(part, mode, recompute, 0.5);
      ASSERT_EQ(m.forward.size(), 3u);
      EXPECT_EQ(m.communication, 0.5);
      EXPECT_EQ(m.recompute.size(), recompute ? 3u : 0u);
      for (int s = 0; s < 3; ++s) {
        const llm::ChunkSpec& chunk = part.chunks[s];
        EXPECT_DOUBLE_EQ(m.forward[s], kF.of(chunk));
        EXPECT_DOUBLE_EQ(m.backward[s], kB.of(chunk));
        EXPECT_DOUBLE_EQ(m.backward_input[s], mode == BackwardMode::kSplit ? kI.of(chunk) : 0.0);
        EXPECT_EQ(m.backward_weight[s], mode == BackwardMode::kSplit ? 1e-9 : 0.0);
        if (recompute) EXPECT_DOUBLE_EQ(m.recompute[s], m.forward[s]);
      }
    }
  }
}

TEST(EstimateLlamaCosts, FlopsAtTheGivenRate) {
  const llm::LlamaConfig c = model();
  const LlamaCosts e = estimate_llama_costs(c, kSeq, 2, 50.0);
  EXPECT_EQ(e.kind, LlamaCosts::Kind::kEstimated);
  EXPECT_NEAR(e.forward.per_block, llm::block_forward_flops(c, kSeq) * 2 * 1e3 / 50e12, 1e-18);
  EXPECT_NEAR(e.forward.head, llm::head_cost_in_blocks(c, kSeq) * e.forward.per_block, 1e-18);
  // By default I, W and B at the ratios a run measured (one 7B stage on an H200, docs/GPU.md).
  const BackwardRatios measured = measured_backward_ratios();
  EXPECT_NEAR(measured.input, 40.49 / 31.86, 1e-12);
  EXPECT_NEAR(measured.weight, 22.05 / 31.86, 1e-12);
  EXPECT_NEAR(measured.fused, 62.69 / 31.86, 1e-12);
  expect_terms(e.backward_input, e.forward.scaled(measured.input), "I");
  expect_terms(e.backward_weight, e.forward.scaled(measured.weight), "W");
  expect_terms(e.backward, e.forward.scaled(measured.fused), "B");
  EXPECT_NE(e.how.find("docs/GPU.md"), std::string::npos) << e.how;
  // FLOP counts alone: I = W = F, B = 2F.
  const LlamaCosts flops = estimate_llama_costs(c, kSeq, 2, 50.0, flop_backward_ratios());
  expect_terms(flops.backward_input, flops.forward, "I = F");
  expect_terms(flops.backward_weight, flops.forward, "W = F");
  expect_terms(flops.backward, flops.forward.scaled(2.0), "B = 2F");
  // Any measured times, e.g. a `twobp_bench split` path's.
  const BackwardRatios split = backward_ratios(2.0, 3.0, 1.0, 4.0, "split.json");
  EXPECT_EQ(split.input, 1.5);
  EXPECT_EQ(split.weight, 0.5);
  EXPECT_EQ(split.fused, 2.0);
  EXPECT_THROW(backward_ratios(0.0, 3.0, 1.0, 4.0, "bad"), UsageError);
  EXPECT_THROW(estimate_llama_costs(c, kSeq, 1, 0.0), UsageError);
}

LayoutPlanOptions plan_options() {
  LayoutPlanOptions o;
  o.ranks = 4;
  o.seq = kSeq;
  o.micro_batch_size = 1;
  o.global_batch = 16;
  o.communication_ms = 0.05;
  o.link_bytes_per_s = 1e9;
  o.link_latency_s = 1e-5;
  o.precision = llm::training_precision(Precision::kFloat32);
  return o;
}

TEST(PlanLlamaLayouts, EveryLayoutOfTheRanksRankedByTheSimulator) {
  const llm::LlamaConfig config = model();
  const LlamaCosts costs = estimate_llama_costs(config, kSeq, 1, 0.001);
  const LayoutPlanOptions o = plan_options();
  const LayoutPlan plan = plan_llama_layouts(config, costs, o);
  ASSERT_FALSE(plan.candidates.empty());
  std::set<int> dps;
  std::set<std::string> names;
  for (std::size_t k = 0; k < plan.candidates.size(); ++k) {
    const LayoutCandidate& c = plan.candidates[k];
    SCOPED_TRACE(c.schedule + " dp " + std::to_string(c.dp));
    EXPECT_EQ(c.dp * c.pp, o.ranks);
    EXPECT_EQ(c.dp * c.m * o.micro_batch_size, o.global_batch);
    EXPECT_TRUE(c.fits);  // no limit
    EXPECT_EQ(static_cast<int>(c.memory_per_rank.size()), c.pp);
    EXPECT_EQ(c.peak_memory, *std::max_element(c.memory_per_rank.begin(), c.memory_per_rank.end()));
    EXPECT_NEAR(c.tokens_per_s, static_cast<double>(o.global_batch * o.seq) / (c.step_ms / 1e3),
                1e-9 * c.tokens_per_s);
    if (k > 0) EXPECT_GE(plan.candidates[k - 1].tokens_per_s, c.tokens_per_s);
    dps.insert(c.dp);
    names.insert(c.schedule);
    if (c.dp == 1) {  // no all-reduce: exactly the simulator on the partition's costs
      // synth as the planner synthesizes it: for these costs (without recomputation), with o.synthesis's search.
      const Schedule s = make_schedule_for_costs(
          c.schedule, default_schedule_options(c.schedule, c.pp, c.m, c.mode),
          [&](const std::vector<int>& owners) {
            return costs.cost_model(llm::make_partition(config, static_cast<int>(owners.size()), kSeq), c.mode,
                                    false, o.communication_ms);
          },
          o.synthesis);
      CostModel m = costs.cost_model(llm::make_partition(config, s.num_stages, kSeq), c.mode,
                                     !c.recompute_ranks.empty(), o.communication_ms);
      for (std::size_t st = 0; st < m.recompute.size(); ++st) {
        if (!has_rank(c.recompute_ranks, s.stage_to_rank[st])) m.recompute[st] = 0.0;  // only those ranks recompute
      }
      EXPECT_DOUBLE_EQ(c.step_ms, simulate(s, m).step_time);
    }
  }
  EXPECT_EQ(dps, (std::set<int>{1, 2, 4}));
  EXPECT_GE(names.size(), 2u);
  EXPECT_GT(plan.skipped, 0);  // multi-chunk schedules at pp = 1
}

// Runs whose overlapped F&B pairs ran at once give the fit their share of the shorter part hidden, weighted by the
// pairs each ran (both fit paths), carried to other shapes unchanged; the planner then runs DualPipeV's pairs at
// once in the simulator, and only schedules with pairs change.
// Issue 70: the planner plans with the per-action cost (estimate_llama_costs' per_action_ms, `plan --action-ms`):
// every candidate is slower by it, the schedules of more chunks by more, and synth is synthesized for it.
TEST(PlanLlamaLayouts, AFixedCostPerActionCostsMoreChunksMore) {
  const llm::LlamaConfig config = model();
  LayoutPlanOptions o = plan_options();
  o.max_dp = 1;
  o.schedules = {"1f1b", "interleaved-1f1b", "synth"};
  o.modes = {BackwardMode::kSplit};
  o.recompute = {false};
  const double x = 0.5;  // ms, against chunks of some 0.01 ms at 50 TFLOP/s
  const LlamaCosts without = estimate_llama_costs(config, kSeq, 1, 50.0);
  const LlamaCosts with = estimate_llama_costs(config, kSeq, 1, 50.0, measured_backward_ratios(), x);
  std::map<std::string, double> before, grown;
  for (const LayoutCandidate& c : plan_llama_layouts(config, without, o).candidates) before[c.schedule] = c.step_ms;
  for (const LayoutCandidate& c : plan_llama_layouts(config, with, o).candidates) {
    ASSERT_TRUE(before.count(c.schedule)) << c.schedule;
    grown[c.schedule] = c.step_ms - before[c.schedule];
    EXPECT_GT(grown[c.schedule], 0.0) << c.schedule;
    if (c.schedule == "synth") {  // synthesized for the costs with x: the simulator's step under them
      const Schedule s = make_schedule_for_costs(
          "synth", default_schedule_options("synth", c.pp, c.m, c.mode),
          [&](const std::vector<int>& owners) {
            return with.cost_model(llm::make_partition(config, static_cast<int>(owners.size()), kSeq), c.mode,
                                   false, o.communication_ms);
          },
          o.synthesis);
      EXPECT_DOUBLE_EQ(c.step_ms,
                       simulate(s, with.cost_model(llm::make_partition(config, s.num_stages, kSeq), c.mode, false,
                                                   o.communication_ms))
                           .step_time);
    }
  }
  ASSERT_EQ(grown.size(), 3u);
  EXPECT_GT(grown["interleaved-1f1b"], grown["1f1b"]) << "v = 2: twice the actions of v = 1";
}

TEST(PlanLlamaLayouts, OverlappedPairsArePlannedAtTheFittedShare) {
  auto overlapped = [](MeasuredLlamaRun run, double share, int pairs) {
    run.costs.overlap = share;
    run.costs.overlapped_pairs = pairs;
    return run;
  };
  const LlamaCosts fitted = fit_llama_costs(model(), kSeq,
                                            {overlapped(exact_run(2, BackwardMode::kSplit), 0.5, 6),
                                             overlapped(exact_run(4, BackwardMode::kSplit), 0.25, 2),
                                             exact_run(4, BackwardMode::kStandard)});
  ASSERT_EQ(fitted.kind, LlamaCosts::Kind::kFitted) << fitted.how;
  EXPECT_DOUBLE_EQ(fitted.overlap, (0.5 * 6 + 0.25 * 2) / 8);
  EXPECT_NE(fitted.how.find("pairs at once"), std::string::npos) << fitted.how;
  const LlamaCosts shares = fit_llama_costs(model(), kSeq, {overlapped(exact_run(2, BackwardMode::kSplit), 0.5, 6)});
  ASSERT_EQ(shares.kind, LlamaCosts::Kind::kFlopShares);
  EXPECT_DOUBLE_EQ(shares.overlap, 0.5);
  const LlamaCosts in_order =
      fit_llama_costs(model(), kSeq, {exact_run(2, BackwardMode::kSplit), exact_run(4, BackwardMode::kSplit)});
  EXPECT_EQ(in_order.overlap, 0.0);
  EXPECT_EQ(in_order.how.find("pairs at once"), std::string::npos) << in_order.how;
  EXPECT_EQ(fitted.carried(model(), kSeq, 1, model(), 2 * kSeq, 4).overlap, fitted.overlap);
  const llm::Partition partition = llm::make_partition(model(), 4, kSeq);
  EXPECT_EQ(fitted.cost_model(partition, BackwardMode::kSplit, false, 0.0).overlap, fitted.overlap);

  const llm::LlamaConfig config = model();
  LayoutPlanOptions o = plan_options();
  o.schedules = {"dualpipev", "1f1b"};
  o.recompute = {false};
  LlamaCosts costs = estimate_llama_costs(config, kSeq, 1, 0.001);
  const LayoutPlan before = plan_llama_layouts(config, costs, o);
  costs.overlap = 0.75;
  const LayoutPlan after = plan_llama_layouts(config, costs, o);
  ASSERT_EQ(before.candidates.size(), after.candidates.size());
  auto key = [](const LayoutCandidate& c) {
    return c.schedule + (c.mode == BackwardMode::kSplit ? " 2bp" : " standard") + " dp " + std::to_string(c.dp);
  };
  std::map<std::string, double> step_before;
  for (const LayoutCandidate& c : before.candidates) step_before[key(c)] = c.step_ms;
  int changed = 0;
  for (const LayoutCandidate& c : after.candidates) {
    SCOPED_TRACE(key(c));
    ASSERT_EQ(step_before.count(key(c)), 1u);
    if (c.schedule != "dualpipev") {
      EXPECT_EQ(c.step_ms, step_before[key(c)]);
      continue;
    }
    changed += c.step_ms != step_before[key(c)];
    if (c.dp == 1) {  // no all-reduce: exactly the simulator with the pairs at once
      const Schedule s = make_schedule(c.schedule, default_schedule_options(c.schedule, c.pp, c.m, c.mode));
      const CostModel m = costs.cost_model(llm::make_partition(config, s.num_stages, kSeq), c.mode, false,
                                           o.communication_ms);
      EXPECT_EQ(m.overlap, 0.75);
      EXPECT_DOUBLE_EQ(c.step_ms, simulate(s, m).step_time);
    }
  }
  EXPECT_GT(changed, 0);
}

// Recomputation is planned per set of pipeline ranks: each form once with no recomputation and once with the first
// j = 1 .. pp ranks of recompute_order by its peaks without recomputation (the ranks where the memory is first:
// with this model's vocabulary the last rank of GPipe, which holds every micro-batch's logits). A rank's memory is
// that of the same form with no rank or with every rank recomputing, by whether the rank is in the set (its memory
// changes only by its own recomputation), and the predicted step never gets shorter as more ranks recompute.
TEST(PlanLlamaLayouts, RecomputationIsPlannedWhereTheMemoryIs) {
  const llm::LlamaConfig config = model();
  const LlamaCosts costs = estimate_llama_costs(config, kSeq, 1, 0.001);
  LayoutPlanOptions o = plan_options();
  o.max_dp = 1;
  o.schedules = {"1f1b", "zb-v", "interleaved-1f1b", "gpipe"};
  const LayoutPlan plan = plan_llama_layouts(config, costs, o);
  std::map<std::pair<std::string, BackwardMode>, std::map<std::size_t, const LayoutCandidate*>> forms;
  for (const LayoutCandidate& c : plan.candidates) {
    const bool first = forms[{c.schedule, c.mode}].emplace(c.recompute_ranks.size(), &c).second;
    ASSERT_TRUE(first) << "a setting twice";
  }
  ASSERT_EQ(forms.size(), 8u);
  for (const auto& [form, by_ranks] : forms) {
    SCOPED_TRACE(form.first + (form.second == BackwardMode::kSplit ? " 2bp" : " standard"));
    std::vector<std::size_t> settings;
    for (const auto& [j, c] : by_ranks) settings.push_back(j);
    ASSERT_EQ(settings, (std::vector<std::size_t>{0, 1, 2, 3, 4}));
    const LayoutCandidate& none = *by_ranks.at(0);
    const LayoutCandidate& all = *by_ranks.at(4);
    const std::vector<int> order = recompute_order(none.memory_per_rank, none.pp);
    for (const auto& [j, c] : by_ranks) {
      EXPECT_EQ(c->recompute_ranks, first_ranks_of(order, static_cast<int>(j)));
      for (int r = 0; r < c->pp; ++r) {
        EXPECT_DOUBLE_EQ(c->memory_per_rank[r], (has_rank(c->recompute_ranks, r) ? all : none).memory_per_rank[r])
            << "j " << j << " rank " << r;
      }
      if (j > 0) EXPECT_GE(c->step_ms, by_ranks.at(j - 1)->step_ms - 1e-9) << "j " << j;
    }
    if (form.first == "gpipe") EXPECT_EQ(by_ranks.at(1)->recompute_ranks, std::vector<int>{3});
    // Recomputing everywhere costs memory nowhere; in standard forms it saves some somewhere (2BP forms may peak
    // on the deferred W's inputs, which it keeps: GPipe's do).
    bool fewer_somewhere = false;
    for (int r = 0; r < 4; ++r) {
      EXPECT_LE(all.memory_per_rank[r], none.memory_per_rank[r]) << "rank " << r;
      fewer_somewhere = fewer_somewhere || all.memory_per_rank[r] < none.memory_per_rank[r];
    }
    if (form.second == BackwardMode::kStandard) EXPECT_TRUE(fewer_somewhere);
    EXPECT_GT(all.step_ms, none.step_ms);
  }
  o.recompute = {true};
  for (const LayoutCandidate& c : plan_llama_layouts(config, costs, o).candidates) {
    EXPECT_FALSE(c.recompute_ranks.empty()) << "recompute {true} plans no candidate without it";
  }
}

TEST(PlanLlamaLayouts, AMemoryLimitPutsTheFittingCandidatesFirst) {
  const llm::LlamaConfig config = model();
  const LlamaCosts costs = estimate_llama_costs(config, kSeq, 1, 0.001);
  LayoutPlanOptions o = plan_options();
  const LayoutPlan all = plan_llama_layouts(config, costs, o);
  std::vector<double> peaks;
  for (const LayoutCandidate& c : all.candidates) peaks.push_back(c.peak_memory);
  std::sort(peaks.begin(), peaks.end());
  ASSERT_LT(peaks.front(), peaks.back());
  o.memory_limit_bytes = peaks[peaks.size() / 2];
  const LayoutPlan limited = plan_llama_layouts(config, costs, o);
  ASSERT_EQ(limited.candidates.size(), all.candidates.size());
  bool seen_unfit = false;
  for (const LayoutCandidate& c : limited.candidates) {
    EXPECT_EQ(c.fits, c.peak_memory <= o.memory_limit_bytes);
    if (!c.fits) seen_unfit = true;
    EXPECT_FALSE(seen_unfit && c.fits) << "a fitting candidate after one that does not fit";
  }
  EXPECT_TRUE(seen_unfit);
  EXPECT_TRUE(limited.candidates.front().fits);
}

TEST(PlanLlamaLayouts, RefusesShapesWithNoCandidate) {
  const llm::LlamaConfig config = model();
  const LlamaCosts costs = estimate_llama_costs(config, kSeq, 1, 1.0);
  LayoutPlanOptions o = plan_options();
  o.global_batch = 3;
  o.micro_batch_size = 2;  // no dp · 2 divides 3
  try {
    plan_llama_layouts(config, costs, o);
    ADD_FAILURE() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no candidate"), std::string::npos) << e.what();
  }
  o.micro_batch_size = 1;
  o.global_batch = 0;
  EXPECT_THROW(plan_llama_layouts(config, costs, o), UsageError);
  o.global_batch = 16;
  o.max_dp = 0;
  o.link_bytes_per_s = 0;  // dp > 1 needs a bandwidth
  EXPECT_THROW(plan_llama_layouts(config, costs, o), UsageError);
}

// Issue 69: a communication time, latency or bandwidth that is NaN, infinite or negative (a communication time past
// 1e9 ms too) is refused naming the field before anything is planned; so is a NaN memory limit.
TEST(PlanLlamaLayouts, RefusesTimesAndBandwidthsThatAreNotOnes) {
  const llm::LlamaConfig config = model();
  const LlamaCosts costs = estimate_llama_costs(config, kSeq, 1, 1.0);
  const double inf = std::numeric_limits<double>::infinity();
  using Field = double LayoutPlanOptions::*;
  const std::pair<const char*, Field> fields[] = {{"communication_ms", &LayoutPlanOptions::communication_ms},
                                                  {"link_latency_s", &LayoutPlanOptions::link_latency_s},
                                                  {"link_bytes_per_s", &LayoutPlanOptions::link_bytes_per_s},
                                                  {"memory_limit_bytes", &LayoutPlanOptions::memory_limit_bytes}};
  for (const auto& [name, field] : fields) {
    for (double bad : {std::nan(""), inf, -inf, -1.0}) {
      if (field == &LayoutPlanOptions::memory_limit_bytes && !std::isnan(bad)) continue;  // <= 0: none; inf: all fit
      LayoutPlanOptions o = plan_options();
      o.*field = bad;
      try {
        plan_llama_layouts(config, costs, o);
        ADD_FAILURE() << name << " = " << bad << " was taken";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("plan_llama_layouts: LayoutPlanOptions.") + name + " is "),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace twobp
