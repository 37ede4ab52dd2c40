// `twobp_bench simulate`: scale planning without running a model. For every built-in schedule and both backward
// modes it generates the schedule for p ranks, m micro-batches and v chunks per rank, and runs twobp::simulate()
// on per-stage costs given on the command line or taken from a `pipeline` result.
//
//   twobp_bench simulate --ranks 64 --microbatches 256 --f 1 --i 1 --w 1 --comm 0.1 --json sim.json
//   twobp_bench simulate --from-json pipeline.json --result 0 --ranks 16 --microbatches 64
//
// Costs (milliseconds, or any unit: the results use the same one; with --dp > 1 milliseconds, the all-reduce's unit):
//   --f/--i/--w/--b are per RANK, i.e. per stage of a v = 1 pipeline (B defaults to I + W; W is per micro-batch).
//   A schedule with v chunks per rank runs the same model on the same ranks cut into v times more stages, so each
//   chunk costs (per-rank cost) / v. --comm is per message and is not scaled. --overlap S: overlapped F&B pairs
//   (DualPipeV's) run at once, hiding the share S of the shorter part (CostModel::overlap; default 0, in order).
//   --from-json FILE takes costs_ms, communication_ms and overlap (unless --overlap) of result K (--result,
//   default 0) of a `pipeline` JSON.
//   A pipeline result holds only its own mode's backward (standard: B; 2bp: I and W), so the result with the same
//   schedule, p, m, v and the other mode, when the file has it, supplies the missing one (B = I + W otherwise;
//   without any 2bp result there are no I/W costs and the command fails). Measured per-stage costs are mapped
//   onto the simulated shape as follows (the chosen rule is printed and stored as "cost_rule"):
//     same p and the same stage placement as measured   each stage keeps its measured cost ("per-stage")
//     same p, other v                                   chunk on rank r = Σ measured stages of rank r / v
//                                                       ("per-rank / v")
//     other p                                           every chunk = mean over measured ranks of the rank's
//                                                       total / v ("mean-rank / v": a model that grows with p,
//                                                       every rank holding as much work as a measured one)
//
// Data parallelism (--dp N > 1; N = 1, the default, changes nothing and adds no fields): N replicas of the
// pipeline, each stage's gradients all-reduced over its N replicas after every step, on one link per rank that
// is separate from compute and from pipeline messages (CostModel::data_parallel_reduce).
//   --model-params P   parameters of the whole model (default 7e9, LLaMa-7B), split evenly over the schedule's
//                      stages: a stage holds P / (p · v), a rank P / p
//   --grad-bytes B     bytes per gradient element (default 2: bf16 gradients, as the 7B measurements)
//   --link-gbps X, --link-latency-us L   one rank's data-parallel link: X gigabit/s (default 100) and L µs per
//                      ring step (default 5)
//   stage all-reduce   metrics::ring_all_reduce_seconds(P / (p · v) · B, N, X · 1e9 / 8, L · 1e-6), in ms
//   --dp-overlap on|off|both (default both): on = a stage's all-reduce starts when its last W (2bp) or B
//                      (standard) ends, overlapping the rank's remaining work; off = after the rank's last action.
//                      both gives each schedule and mode one row per setting.
//   --dp-buckets K     each stage's all-reduce in K equal buckets (default 4); with overlap, after a W they start
//                      one by one during it (bucket j at (j+1)/K of the W), as the runtime starts a bucket once the
//                      layers that fill it ran in the stage's last W; after a B all at its end (CostModel docs)
//
// synth (twobp/plan/synthesize.h) is synthesized for these costs instead of taken from the registry with its
// textbook ones: once per v of --synth-chunks (default: the v every schedule gets), within --synth-memory
// micro-batches of a whole rank's activations (default 1F1B standard's, min(p, m)), searching --synth-work.
//
// Metrics (docs/BENCHMARKS.md repeats them), per schedule and mode, from simulate(schedule, costs):
//   sim_step_ms              the simulated step time: each rank runs its actions in order; an F/I/B waits until
//                            its input arrived, `comm` after the producing action finished
//   sim_bubble_fraction      idle compute time / (p · sim_step_ms)
//   peak_live_microbatches   max over ranks of micro-batches whose activations are alive at once
//   speedup_vs_standard      sim_step_ms(standard) / sim_step_ms(2bp), same schedule, p, m, v (2bp rows only;
//                            with --dp > 1 also the same dp_overlap)
//   speedup_vs_1f1b_standard sim_step_ms of 1F1B standard (v = 1, the same costs, p, m and dp_overlap) /
//                            sim_step_ms (not with --schedule-file); the table's "2bp vs 1f1b std"
//   with --dp > 1 (sim_step_ms and sim_bubble_fraction then include the exposed all-reduce time):
//   dp, dp_overlap           N, and whether the all-reduces overlap (true) or follow the rank's last action
//   dp_reduce_ms             the all-reduce time of one rank per step: max over ranks of the sum of its stages'
//                            all-reduces (v chunks: v all-reduces of 1/v of the rank's gradients each)
//   dp_exposed_ms            SimulationResult::data_parallel_exposed: max over ranks of how far the all-reduces
//                            pushed the rank's step end past its last action (0: fully hidden)
//   generate_ms, simulate_ms wall time this tool spent generating+validating and simulating the schedule
// Shapes a schedule rejects (e.g. interleaved-1f1b with p = 4, m = 9) are listed with the reason.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "twobp/metrics/metrics.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/synthesize.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"
#include "twobp_cli.h"

namespace twobp::bench {
namespace {

struct SimulateArgs {
  double f = 1, i = 1, w = 1, b = -1, comm = 0;  // b < 0: I + W
  // --w-batched K MS: a W of K micro-batches costs MS; with --w (one micro-batch's) W is fit_weight_cost's line.
  std::vector<double> w_batched;
  std::string from_json;
  int result = 0;
  int ranks = 4;
  int microbatches = 8;
  int chunks_per_rank = 0;  // 0: the schedule's default (as `pipeline`)
  std::string schedule = "all";
  std::string schedule_file;  // overrides --schedule; its own ranks, micro-batches and mode
  std::string mode = "both";
  std::string json;
  std::string dump_schedules;  // a directory: every simulated schedule written there (text form and PyTorch CSV)
  // Data parallelism (see the header comment); dp = 1: none.
  int dp = 1;
  int dp_buckets = 4;
  double link_gbps = 100;
  double link_latency_us = 5;
  double model_params = 7e9;
  double grad_bytes = 2;
  std::string dp_overlap = "both";
  bool recompute = false;  // activation recomputation: every I and B first re-runs its stage's forward
  double overlap = -1;     // overlapped pairs run at once, this share hidden (CostModel::overlap); < 0: the costs'
  // synth (twobp/plan/synthesize.h): its v's (empty: as every schedule), budget and search effort.
  std::vector<int> synth_chunks;
  int synth_memory = 0;  // activations per rank in a whole rank's micro-batches (0: 1F1B's, min(p, m))
  double synth_work = 20e6;
};

/// Where the costs come from: per-rank constants (command line) or a measured pipeline result.
struct CostSource {
  bool measured = false;
  std::string description;
  double comm = 0;
  double overlap = 0;  // CostModel::overlap: --overlap, else what the measured run's pairs hid (else 0)
  // Command line: per-rank costs (w0: the fixed part of each W, CostModel::backward_weight_fixed).
  double f = 0, i = 0, w = 0, b = 0, w0 = 0;
  // Measured: per measured stage, and the measured placement.
  std::string schedule;
  int p = 0, m = 0, v = 0;
  std::vector<double> F, I, W, B;
  std::vector<double> W0;  // the fixed part of each W (MeasuredCosts::backward_weight_fixed); empty: none
  std::vector<int> stage_to_rank;
};

bool any_positive(const std::vector<double>& v) {
  return std::any_of(v.begin(), v.end(), [](double x) { return x > 0; });
}

CostSource load_costs(const SimulateArgs& a) {
  CostSource c;
  if (a.from_json.empty()) {
    c.f = a.f;
    c.i = a.i;
    c.w = a.w;
    c.b = a.b >= 0 ? a.b : a.i + a.w;  // a B's weight part is a W of one micro-batch
    c.comm = a.comm;
    std::string batched;
    if (!a.w_batched.empty()) {
      const int k = static_cast<int>(a.w_batched[0]);
      if (k < 2 || static_cast<double>(k) != a.w_batched[0]) {
        throw std::runtime_error(fmt::format("--w-batched {} {}: the micro-batch count must be an integer >= 2",
                                             a.w_batched[0], a.w_batched[1]));
      }
      const WeightCost w = fit_weight_cost({{1, {a.w}}, {k, {a.w_batched[1]}}});
      c.w = w.per_micro_batch;
      c.w0 = w.fixed;
      batched = fmt::format(" (a W of 1 micro-batch {} ms, of {} {} ms: W0={:.4g} + W per micro-batch)", a.w, k,
                            a.w_batched[1], c.w0);
    }
    c.overlap = std::max(a.overlap, 0.0);
    c.description = fmt::format("command line, per rank: F={} I={} W={:.4g} B={}{} comm={}{}{}", c.f, c.i, c.w, c.b,
                                a.b >= 0 ? "" : " (I+W)", c.comm, batched,
                                c.overlap > 0 ? fmt::format(" overlap={}", c.overlap) : "");
    return c;
  }
  const Json doc = read_json(a.from_json);
  if (!doc.contains("results") || !doc["results"].is_array() || doc["results"].empty()) {
    throw std::runtime_error(a.from_json + ": no \"results\" array (not a `twobp_bench pipeline` JSON?)");
  }
  const Json& results = doc["results"];
  if (a.result < 0 || a.result >= static_cast<int>(results.size())) {
    throw std::runtime_error(fmt::format("{}: --result {} out of range (the file has {} results)", a.from_json,
                                         a.result, results.size()));
  }
  const Json& r = results[a.result];
  for (const char* key : {"schedule", "mode", "p", "m", "v"}) {
    if (!r.contains(key)) throw std::runtime_error(fmt::format("{}: result {} has no \"{}\"", a.from_json, a.result, key));
  }
  c.measured = true;
  c.schedule = r["schedule"].get<std::string>();
  c.p = r["p"].get<int>();
  c.m = r["m"].get<int>();
  c.v = r["v"].get<int>();
  const MeasuredCosts measured = parse_measured_costs(r.dump(), fmt::format("{}: result {}", a.from_json, a.result));
  c.comm = measured.communication;
  c.overlap = a.overlap >= 0 ? a.overlap : measured.overlap;
  c.F = measured.forward;
  c.I = measured.backward_input;
  c.W = measured.backward_weight;
  c.W0 = measured.backward_weight_fixed;
  c.B = measured.backward;
  std::string partner_note;
  const Json* partner = nullptr;
  for (const auto& o : results) {
    if (o.value("schedule", "") == c.schedule && o.value("p", 0) == c.p && o.value("m", 0) == c.m &&
        o.value("v", 0) == c.v && o.value("mode", "") != r["mode"].get<std::string>() && o.contains("costs_ms")) {
      partner = &o;
    }
  }
  const std::optional<MeasuredCosts> other =
      partner ? std::optional<MeasuredCosts>(parse_measured_costs(partner->dump(), a.from_json + ": its partner result"))
              : std::nullopt;
  if (!any_positive(c.I) && other) {
    c.I = other->backward_input;
    c.W = other->backward_weight;
    c.W0 = other->backward_weight_fixed;
    partner_note += " I,W from its 2bp partner;";
  }
  if (!any_positive(c.I)) {
    throw std::runtime_error(fmt::format("{}: result {} ({} {}) has no I/W costs and no 2bp partner result; run "
                                         "`pipeline --mode both` (or 2bp)", a.from_json, a.result, c.schedule,
                                         r["mode"].get<std::string>()));
  }
  if (!any_positive(c.B) && other && any_positive(other->backward)) {
    c.B = other->backward;
    partner_note += " B from its standard partner;";
  }
  const std::size_t S = c.F.size();
  if (S == 0 || c.I.size() != S || c.W.size() != S) {
    throw std::runtime_error(fmt::format("{}: result {}: costs_ms F/I/W sizes differ or are empty", a.from_json, a.result));
  }
  if (!any_positive(c.B)) {
    CostModel parts;  // the measured stages' split parts, for the simulator's fused-B rule
    parts.backward_input = c.I;
    parts.backward_weight = c.W;
    parts.backward_weight_fixed = c.W0;
    c.B.resize(S);
    for (std::size_t s = 0; s < S; ++s) c.B[s] = parts.unfused_backward(static_cast<int>(s));
    partner_note += " B = I + W (no standard result);";
  } else if (c.B.size() != S) {
    throw std::runtime_error(fmt::format("{}: result {}: costs_ms B has {} stages, F {}", a.from_json, a.result,
                                         c.B.size(), S));
  }
  // The measured placement: regenerate the measured schedule (cheap) for its stage -> rank map.
  ScheduleOptions so{c.p, c.m, c.v, BackwardMode::kSplit};
  c.stage_to_rank = make_schedule(c.schedule, so).stage_to_rank;
  if (c.stage_to_rank.size() != S) {
    throw std::runtime_error(fmt::format("{}: result {}: {} stage costs, but {} p={} v={} has {} stages", a.from_json,
                                         a.result, S, c.schedule, c.p, c.v, c.stage_to_rank.size()));
  }
  c.description = fmt::format("{} result {} ({} {} p={} m={} v={}),{} comm={}{}", a.from_json, a.result, c.schedule,
                              r["mode"].get<std::string>(), c.p, c.m, c.v, partner_note, c.comm,
                              c.overlap > 0 ? fmt::format(" overlap={:.3g}", c.overlap) : "");
  return c;
}

/// Per-stage costs for `target` from `src`; `rule` says which mapping was used.
CostModel costs_for(const Schedule& target, const CostSource& src, std::string& rule) {
  const int S = target.num_stages, P = target.num_ranks;
  const double v = static_cast<double>(S) / P;
  CostModel c;
  c.communication = src.comm;
  c.overlap = src.overlap;
  c.forward.resize(S);
  c.backward_input.resize(S);
  c.backward_weight.resize(S);
  c.backward.resize(S);
  if (!src.W0.empty() || src.w0 > 0) c.backward_weight_fixed.resize(S);  // mapped as W is
  auto fill = [&](int s, double f, double i, double w, double b, double w0 = 0.0) {
    c.forward[s] = f;
    c.backward_input[s] = i;
    c.backward_weight[s] = w;
    c.backward[s] = b;
    if (!c.backward_weight_fixed.empty()) c.backward_weight_fixed[s] = w0;
  };
  auto w0_of = [&](std::size_t s) { return src.W0.empty() ? 0.0 : src.W0[s]; };
  if (!src.measured) {
    rule = "per-rank / v";
    for (int s = 0; s < S; ++s) fill(s, src.f / v, src.i / v, src.w / v, src.b / v, src.w0 / v);
    return c;
  }
  if (P == src.p && target.stage_to_rank == src.stage_to_rank) {
    rule = "per-stage";
    for (int s = 0; s < S; ++s) fill(s, src.F[s], src.I[s], src.W[s], src.B[s], w0_of(s));
    return c;
  }
  // Per measured rank totals.
  std::vector<double> f(src.p), i(src.p), w(src.p), b(src.p), w0(src.p);
  for (std::size_t s = 0; s < src.F.size(); ++s) {
    const int r = src.stage_to_rank[s];
    f[r] += src.F[s];
    i[r] += src.I[s];
    w[r] += src.W[s];
    b[r] += src.B[s];
    w0[r] += w0_of(s);
  }
  if (P == src.p) {
    rule = "per-rank / v";
    for (int s = 0; s < S; ++s) {
      const int r = target.stage_to_rank[s];
      fill(s, f[r] / v, i[r] / v, w[r] / v, b[r] / v, w0[r] / v);
    }
    return c;
  }
  rule = "mean-rank / v";
  auto mean = [&](const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0) / x.size(); };
  for (int s = 0; s < S; ++s) fill(s, mean(f) / v, mean(i) / v, mean(w) / v, mean(b) / v, mean(w0) / v);
  return c;
}

/// Adds the data-parallel all-reduce of every stage to `costs` (ms): the model's parameters split evenly over the
/// schedule's stages, all-reduced over `a.dp` replicas on a ring. Returns the max over ranks of the sum of the
/// rank's stages' all-reduces (dp_reduce_ms).
double add_data_parallel(const Schedule& sched, const SimulateArgs& a, bool overlap, CostModel& costs) {
  const double stage_bytes = a.model_params / sched.num_stages * a.grad_bytes;
  // K buckets of stage_bytes / K each, every one paying the ring's latency.
  const double stage_ms = a.dp_buckets * 1e3 *
                          metrics::ring_all_reduce_seconds(stage_bytes / a.dp_buckets, a.dp, a.link_gbps * 1e9 / 8,
                                                           a.link_latency_us * 1e-6);
  costs.data_parallel_reduce.assign(sched.num_stages, stage_ms);
  costs.overlap_data_parallel = overlap;
  costs.data_parallel_buckets = a.dp_buckets;
  double per_rank = 0;
  for (int r = 0; r < sched.num_ranks; ++r) {
    double sum = 0;
    for (int s : sched.stages_of(r)) sum += costs.data_parallel_reduce[s];
    per_rank = std::max(per_rank, sum);
  }
  return per_rank;
}

struct SimRow {
  std::string schedule;
  BackwardMode mode;
  int p = 0, m = 0, v = 0, stages = 0;
  double step = 0, bubble = 0, generate_ms = 0, simulate_ms = 0;
  int peak_live = 0;
  std::string rule;
  bool dp_overlap = false;  // only meaningful with --dp > 1
  double dp_reduce_ms = 0, dp_exposed_ms = 0;
  double vs_1f1b_standard = 0;  // 1F1B standard's step (v = 1, same costs) / this step; 0: not computed
};

struct Rejected {
  std::string schedule;
  int v = 0;
  std::string reason;
};

int chunks_for(const SimulateArgs& a, const std::string& schedule) {
  return a.chunks_per_rank > 0 ? a.chunks_per_rank : schedule_info(schedule).default_chunks_per_rank;
}

// The v's `schedule` is simulated with: --synth-chunks for synth, else the one of chunks_for.
std::vector<int> chunk_counts(const SimulateArgs& a, const std::string& schedule) {
  if (schedule == "synth" && !a.synth_chunks.empty()) return a.synth_chunks;
  return {chunks_for(a, schedule)};
}

// synth for the run's costs: each placement it tries priced as costs_for() prices a schedule of that placement.
Schedule synthesize_for(const SimulateArgs& a, const CostSource& src, const ScheduleOptions& options) {
  auto costs = [&](const std::vector<int>& stage_to_rank) {
    Schedule shape;
    shape.num_ranks = options.ranks;
    shape.num_stages = static_cast<int>(stage_to_rank.size());
    shape.stage_to_rank = stage_to_rank;
    std::string rule;
    CostModel c = costs_for(shape, src, rule);
    if (a.recompute) c.recompute = c.forward;
    return c;
  };
  SynthesisOptions search;
  search.max_work = static_cast<std::int64_t>(a.synth_work);
  return SynthesizedScheduleGenerator(costs, a.synth_memory, search).generate(options);
}

// 1F1B standard's step time (v = 1) under the same costs: the reference of the "vs 1f1b std" column.
double one_f_one_b_standard_ms(const SimulateArgs& a, const CostSource& src, bool overlap) {
  const Schedule sched = make_schedule("1f1b", ScheduleOptions{a.ranks, a.microbatches, 1, BackwardMode::kStandard});
  std::string rule;
  CostModel costs = costs_for(sched, src, rule);
  if (a.recompute) costs.recompute = costs.forward;
  if (a.dp > 1) add_data_parallel(sched, a, overlap, costs);
  return simulate(sched, costs).step_time;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// What run_simulate simulates: the schedules and modes of the command line, or the one schedule of a file.
struct SimulatePlan {
  std::vector<std::string> names;
  std::vector<BackwardMode> modes;
  std::vector<bool> overlaps;  // without data parallelism one pass, the setting unused; with it, per --dp-overlap
  Schedule from_file;          // --schedule-file (num_stages 0 when none)
};

SimulatePlan simulate_plan(const SimulateArgs& a) {
  SimulatePlan plan;
  const bool dp = a.dp > 1;
  plan.overlaps = {true};
  if (dp && a.dp_overlap == "off") plan.overlaps = {false};
  if (dp && a.dp_overlap == "both") plan.overlaps = {true, false};
  plan.names = a.schedule == "all" ? schedule_names() : std::vector<std::string>{a.schedule};
  plan.modes = mode_list(a.mode);
  if (!a.schedule_file.empty()) {
    plan.from_file = load_schedule_file(a.schedule_file);
    validate(plan.from_file);
    plan.names = {plan.from_file.name};
    plan.modes = {plan.from_file.backward};
  }
  return plan;
}

// One schedule x mode x v: generated (synth: for these costs), validated, dumped if asked, and simulated once per
// overlap setting; a shape the schedule rejects is recorded once per reason.
// `reference`: 1F1B standard's step per overlap setting of the plan (empty: none).
void simulate_one(const SimulateArgs& a, const CostSource& src, const SimulatePlan& plan, const std::string& name,
                  int v, BackwardMode mode, const std::vector<double>& reference, std::vector<SimRow>& rows,
                  std::vector<Rejected>& rejected) {
  const bool from_file = !a.schedule_file.empty();
  SimRow row;
  row.schedule = name;
  row.mode = mode;
  row.p = from_file ? plan.from_file.num_ranks : a.ranks;
  row.m = from_file ? plan.from_file.num_micro_batches : a.microbatches;
  auto t0 = std::chrono::steady_clock::now();
  Schedule sched;
  try {
    const ScheduleOptions options{a.ranks, a.microbatches, v, mode};
    sched = from_file         ? plan.from_file
            : name == "synth" ? synthesize_for(a, src, options)
                              : make_schedule(name, options);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    reason = reason.substr(0, reason.find('\n'));  // validation errors append a grid
    const bool seen = !rejected.empty() && rejected.back().schedule == name && rejected.back().reason == reason;
    if (!seen) rejected.push_back({name, v, reason});
    return;
  }
  row.generate_ms = ms_since(t0);
  if (!a.dump_schedules.empty()) {
    // The schedule as simulated, to read back with --schedule-file (here or in llama_pipeline) or in PyTorch.
    const std::string base = fmt::format("{}/{}_{}_p{}_m{}_v{}", a.dump_schedules, name, to_string(mode),
                                         sched.num_ranks, sched.num_micro_batches, sched.num_stages / sched.num_ranks);
    write_text(base + ".txt", dump_schedule(sched));
    write_text(base + ".csv", to_pytorch_csv(sched));
  }
  row.v = sched.num_stages / sched.num_ranks;
  row.stages = sched.num_stages;
  for (std::size_t k = 0; k < plan.overlaps.size(); ++k) {
    const bool overlap = plan.overlaps[k];
    CostModel costs = costs_for(sched, src, row.rule);
    if (a.recompute) costs.recompute = costs.forward;  // the re-run forward costs what F costs
    if (a.dp > 1) row.dp_reduce_ms = add_data_parallel(sched, a, overlap, costs);
    row.dp_overlap = overlap;
    t0 = std::chrono::steady_clock::now();
    const SimulationResult sim = simulate(sched, costs);
    row.simulate_ms = ms_since(t0);
    row.step = sim.step_time;
    row.bubble = sim.bubble_fraction;
    row.peak_live = *std::max_element(sim.peak_live_micro_batches.begin(), sim.peak_live_micro_batches.end());
    row.dp_exposed_ms = sim.data_parallel_exposed;
    row.vs_1f1b_standard = reference.empty() ? 0.0 : reference[k] / sim.step_time;
    rows.push_back(row);
  }
}

// Every schedule x v (synth: each of --synth-chunks) x mode of the plan, or the one schedule of the file.
void simulate_all(const SimulateArgs& a, const CostSource& src, const SimulatePlan& plan, std::vector<SimRow>& rows,
                  std::vector<Rejected>& rejected) {
  std::vector<double> reference;
  if (a.schedule_file.empty()) {
    for (bool overlap : plan.overlaps) reference.push_back(one_f_one_b_standard_ms(a, src, overlap));
  }
  for (const auto& name : plan.names) {
    const std::vector<int> counts = a.schedule_file.empty()
                                        ? chunk_counts(a, name)
                                        : std::vector<int>{plan.from_file.num_stages / plan.from_file.num_ranks};
    for (int v : counts) {
      for (BackwardMode mode : plan.modes) simulate_one(a, src, plan, name, v, mode, reference, rows, rejected);
    }
  }
}

// {"config", "results" (one per schedule × mode × overlap), "rejected", "tool_ms"}.
Json simulate_json(const SimulateArgs& a, const CostSource& src, const std::vector<SimRow>& rows,
                   const std::vector<Rejected>& rejected, double total_ms) {
  const bool dp = a.dp > 1;
  Json out;
  out["config"] = {{"ranks", a.ranks},     {"microbatches", a.microbatches}, {"chunks_per_rank", a.chunks_per_rank},
                   {"costs", src.description}, {"communication_ms", src.comm}, {"recompute", a.recompute}};
  if (src.overlap > 0) out["config"]["overlap"] = src.overlap;
  if (!src.measured) {
    out["config"]["costs_ms_per_rank"] = {{"F", src.f}, {"I", src.i}, {"W", src.w}, {"B", src.b}};
    if (src.w0 > 0) out["config"]["costs_ms_per_rank"]["W0"] = src.w0;
  }
  if (dp) {
    out["config"]["data_parallel"] = {{"dp", a.dp},
                                      {"link_gbps", a.link_gbps},
                                      {"link_latency_us", a.link_latency_us},
                                      {"model_params", a.model_params},
                                      {"grad_bytes", a.grad_bytes},
                                      {"overlap", a.dp_overlap},
                                      {"buckets_per_stage", a.dp_buckets}};
  }
  out["results"] = Json::array();
  for (const auto& r : rows) {
    Json j{{"schedule", r.schedule},
           {"mode", to_string(r.mode)},
           {"p", r.p},
           {"m", r.m},
           {"v", r.v},
           {"stages", r.stages},
           {"sim_step_ms", r.step},
           {"sim_bubble_fraction", r.bubble},
           {"peak_live_microbatches", r.peak_live},
           {"cost_rule", r.rule},
           {"generate_ms", r.generate_ms},
           {"simulate_ms", r.simulate_ms}};
    if (r.vs_1f1b_standard > 0) j["speedup_vs_1f1b_standard"] = r.vs_1f1b_standard;
    if (dp) {
      j["dp"] = a.dp;
      j["dp_overlap"] = r.dp_overlap;
      j["dp_reduce_ms"] = r.dp_reduce_ms;
      j["dp_exposed_ms"] = r.dp_exposed_ms;
    }
    for (const auto& o : rows) {  // the standard form of the same schedule, v and overlap
      if (r.mode == BackwardMode::kSplit && o.schedule == r.schedule && o.v == r.v &&
          o.mode == BackwardMode::kStandard && o.dp_overlap == r.dp_overlap) {
        j["speedup_vs_standard"] = o.step / r.step;
        break;
      }
    }
    out["results"].push_back(j);
  }
  out["rejected"] = Json::array();
  for (const auto& r : rejected) {
    out["rejected"].push_back({{"schedule", r.schedule}, {"v", r.v}, {"reason", r.reason}});
  }
  out["tool_ms"] = total_ms;
  return out;
}

// The table: one line per schedule (and overlap setting), both modes side by side.
std::vector<std::vector<std::string>> simulate_table(const SimulateArgs& a, const SimulatePlan& plan,
                                                     const std::vector<SimRow>& rows) {
  const bool dp = a.dp > 1;
  std::vector<std::vector<std::string>> table{{"schedule", "v", "stages", "std ms", "2bp ms", "speedup",
                                               "2bp vs 1f1b std", "std bubble", "2bp bubble", "std peak mbs",
                                               "2bp peak mbs", "cost rule", "tool ms"}};
  if (dp) {
    for (const char* column : {"dp reduce ms", "std exposed", "2bp exposed"}) table[0].push_back(column);
    table[0].insert(table[0].begin() + 1, "dp overlap");
  }
  std::vector<std::pair<std::string, int>> lines;  // (schedule, v) in the order simulated (synth: several v)
  for (const auto& r : rows) {
    const std::pair<std::string, int> line{r.schedule, r.v};
    if (std::find(lines.begin(), lines.end(), line) == lines.end()) lines.push_back(line);
  }
  for (const auto& [name, v] : lines) {
    for (bool overlap : plan.overlaps) {
      const SimRow *s = nullptr, *t = nullptr;
      for (const auto& r : rows) {
        if (r.schedule != name || r.v != v || r.dp_overlap != overlap) continue;
        (r.mode == BackwardMode::kStandard ? s : t) = &r;
      }
      if (!s && !t) continue;
      const SimRow& any = s ? *s : *t;
      auto num = [](const SimRow* r, double SimRow::*field, int digits) { return r ? fmt_num(r->*field, digits) : ""; };
      auto peak = [](const SimRow* r) { return r ? std::to_string(r->peak_live) : ""; };
      std::vector<std::string> line{
          name, std::to_string(any.v), std::to_string(any.stages), num(s, &SimRow::step, 2), num(t, &SimRow::step, 2),
          s && t ? fmt_num(s->step / t->step, 3) : "",
          t && t->vs_1f1b_standard > 0 ? fmt_num(t->vs_1f1b_standard, 3) : "", num(s, &SimRow::bubble, 3),
          num(t, &SimRow::bubble, 3),
          peak(s), peak(t), any.rule,
          fmt_num((s ? s->generate_ms + s->simulate_ms : 0) + (t ? t->generate_ms + t->simulate_ms : 0), 0)};
      if (dp) {
        line.insert(line.begin() + 1, overlap ? "on" : "off");
        line.push_back(fmt_num(any.dp_reduce_ms, 2));
        line.push_back(num(s, &SimRow::dp_exposed_ms, 2));
        line.push_back(num(t, &SimRow::dp_exposed_ms, 2));
      }
      table.push_back(line);
    }
  }
  return table;
}

void run_simulate(const SimulateArgs& a) {
  const CostSource src = load_costs(a);
  const SimulatePlan plan = simulate_plan(a);
  const auto t_all = std::chrono::steady_clock::now();
  std::vector<SimRow> rows;
  std::vector<Rejected> rejected;
  simulate_all(a, src, plan, rows, rejected);
  const double total_ms = ms_since(t_all);
  const Json out = simulate_json(a, src, rows, rejected, total_ms);

  // A schedule file decides p and m (--ranks and --microbatches do not apply to it).
  std::cout << fmt::format("simulate: {}; costs: {}\n",
                           a.schedule_file.empty() ? fmt::format("p={} m={}", a.ranks, a.microbatches)
                                                   : fmt::format("{} (p={} m={})", a.schedule_file,
                                                                 plan.from_file.num_ranks,
                                                                 plan.from_file.num_micro_batches),
                           src.description);
  if (a.dp > 1) {
    std::cout << fmt::format("data parallel: dp={}, {:g} parameters split evenly over the stages, {:g} bytes per "
                             "gradient, ring all-reduce on {:g} Gbit/s with {:g} us per step\n",
                             a.dp, a.model_params, a.grad_bytes, a.link_gbps, a.link_latency_us);
  }
  print_table(std::cout, simulate_table(a, plan, rows));
  for (const auto& r : rejected) std::cout << fmt::format("rejected: {} (v={}): {}\n", r.schedule, r.v, r.reason);
  std::cout << fmt::format("generated, validated and simulated {} configurations in {:.0f} ms\n", rows.size(),
                           total_ms);
  if (!a.json.empty()) {
    write_json(a.json, out);
    std::cout << "wrote " << a.json << "\n";
  }
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto a = std::make_shared<SimulateArgs>();
  CLI::App* sub = app.add_subcommand(
      "simulate", "Predicted step time, bubble and memory of every schedule, 2BP vs standard, from stage costs");
  auto* f = sub->add_option("--f", a->f, "Forward cost per rank (per stage at v=1), ms")->capture_default_str()
                ->check(cli::number_in(0, 1e9));
  auto* i = sub->add_option("--i", a->i, "Input-gradient (2BP stage 1) cost per rank, ms")->capture_default_str()
                ->check(cli::number_in(0, 1e9));
  auto* w = sub->add_option("--w", a->w, "Weight-gradient (2BP stage 2) cost per rank and micro-batch, ms")
                ->capture_default_str()->check(cli::number_in(0, 1e9));
  auto* b = sub->add_option("--b", a->b, "Fused backward cost per rank, ms (default: I + W)")
                ->check(cli::number_in(0, 1e9));
  auto* w_batched =
      sub->add_option("--w-batched", a->w_batched,
                      "K MS: a W of K micro-batches at once costs MS per rank (e.g. `split --batched-w`'s "
                      "batched_w_ms); with --w, one micro-batch's, each W then costs a fixed part + K x per "
                      "micro-batch (the line through the two, twobp::fit_weight_cost)")
          ->expected(2)->check(cli::number_in(0, 1e9));
  auto* comm = sub->add_option("--comm", a->comm, "One-way latency of one activation or gradient, ms")
                   ->capture_default_str()->check(cli::number_in(0, 1e9));
  auto* from = sub->add_option("--from-json", a->from_json, "Take costs from a `twobp_bench pipeline` JSON")
                   ->check(cli::regular_file());
  for (auto* opt : {f, i, w, b, comm, w_batched}) from->excludes(opt);
  sub->add_option("--overlap", a->overlap,
                  "Overlapped F&B pairs (DualPipeV's) run at once, hiding this share of the shorter part "
                  "(CostModel::overlap; 0: in order, as without an overlap hook). Default: 0, or what the "
                  "--from-json run's pairs hid")
      ->check(cli::number_in(0, 1));
  sub->add_option("--result", a->result, "Which result of --from-json (index into \"results\")")
      ->capture_default_str()->needs(from)->check(cli::number_in(0, cli::kMaxCount));
  sub->add_option("--ranks", a->ranks, "p: ranks")->capture_default_str()->check(cli::number_in(1, 64));
  sub->add_option("--microbatches", a->microbatches, "m: micro-batches per step")->capture_default_str()
      ->check(cli::number_in(1, 256));
  sub->add_option("--chunks-per-rank", a->chunks_per_rank,
                  "v for every schedule (default: the schedule's: 2 for the looped and V schedules, else 1); chunk "
                  "cost = cost / v")
      ->check(cli::number_in(0, 16));
  std::vector<std::string> schedules = schedule_names();
  schedules.push_back("all");
  sub->add_option("--schedule", a->schedule, "Registered schedule, or all")->check(CLI::IsMember(schedules))
      ->capture_default_str();
  sub->add_option("--schedule-file", a->schedule_file,
                  "Simulate this schedule (text form, see dump_schedule) instead; its ranks, micro-batches and mode "
                  "win over --ranks, --microbatches and --mode")
      ->check(cli::regular_file());
  sub->add_option("--mode", a->mode, "standard, 2bp or both")->check(CLI::IsMember(mode_choices()))
      ->capture_default_str();
  sub->add_option("--synth-chunks", a->synth_chunks,
                  "v's to synthesize the synth schedule for, one table line each (default: as every schedule, "
                  "--chunks-per-rank or 2): 1 linear, 2 the V or interleaved (the faster), >= 3 interleaved")
      ->delimiter(',')->check(cli::number_in(1, 16));
  sub->add_option("--synth-memory", a->synth_memory,
                  "synth's activation budget per rank, in micro-batches of a whole rank's activations (its v chunks "
                  "each hold 1/v); 0: 1F1B standard's, min(p, m)")
      ->capture_default_str()->check(cli::number_in(0, 65536));
  sub->add_option("--synth-work", a->synth_work,
                  "synth's search effort: the orders it evaluates x their actions (SynthesisOptions::max_work; "
                  "about 25 ns each)")
      ->capture_default_str()->check(cli::number_in(1.0, 1e12));
  sub->add_flag("--recompute", a->recompute,
               "Activation recomputation: every I and B first re-runs its stage's forward (CostModel::recompute = F)");
  sub->add_option("--dump-schedules", a->dump_schedules,
                  "Write every simulated schedule into this directory: <name>_<mode>_p<p>_m<m>_v<v>.txt (twobp's "
                  "text form, for --schedule-file) and .csv (PyTorch's compute_only form)")
      ->check(cli::writable_directory());
  sub->add_option("--json", a->json, "Write {\"config\", \"results\": [...], \"rejected\": [...]} here")
      ->check(cli::writable_file());
  sub->add_option("--dp", a->dp,
                  "Data-parallel replicas of the pipeline; > 1 adds each stage's gradient all-reduce (costs then in "
                  "ms). 1: none, and the DP options below have no effect")
      ->capture_default_str()->check(cli::number_in(1, 65536));
  sub->add_option("--link-gbps", a->link_gbps, "Data-parallel link bandwidth of one rank, gigabit/s")
      ->capture_default_str()->check(cli::number_in(1e-3, 1e6));
  sub->add_option("--link-latency-us", a->link_latency_us, "Data-parallel latency of one ring step, microseconds")
      ->capture_default_str()->check(cli::number_in(0.0, 1e9));
  sub->add_option("--model-params", a->model_params,
                  "Parameters of the whole model (default LLaMa-7B), split evenly over the stages")
      ->capture_default_str()->check(cli::number_in(1.0, 1e15));
  sub->add_option("--grad-bytes", a->grad_bytes, "Bytes per gradient element all-reduced (2: bf16, 4: fp32)")
      ->capture_default_str()->check(cli::number_in(1.0, 16.0));
  sub->add_option("--dp-overlap", a->dp_overlap,
                  "on: a stage's all-reduce starts after its last W/B; off: after the rank's last action; both: one "
                  "row each")
      ->capture_default_str()->check(CLI::IsMember({"on", "off", "both"}));
  sub->add_option("--dp-buckets", a->dp_buckets,
                  "Buckets per stage all-reduce; with overlap they start during the stage's last W")
      ->capture_default_str()->check(cli::number_in(1, 100000));
  sub->callback([a] { run_simulate(*a); });
}

}  // namespace twobp::bench
