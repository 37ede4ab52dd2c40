// `twobp_bench simulate`: scale planning without running a model. For every built-in schedule and both backward
// modes it generates the schedule for p ranks, m micro-batches and v chunks per rank, and runs twobp::simulate()
// on per-stage costs given on the command line or taken from a `pipeline` run document (twobp/plan/record.h).
//
//   twobp_bench simulate --ranks 64 --microbatches 256 --f 1 --i 1 --w 1 --comm 0.1 --json sim.json
//   twobp_bench simulate --from-json pipeline.json --result 0 --ranks 16 --microbatches 64
//
// docs/BENCHMARKS.md ("simulate") defines the costs (per rank; a chunk of v costs 1/v), how measured per-stage
// costs map onto another shape ("cost_rule": per-stage, per-rank / v, mean-rank / v), the data-parallel model
// (--dp ...) and every metric.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "twobp/metrics/metrics.h"
#include "twobp/metrics/step_log.h"
#include "twobp/error.h"
#include "twobp/files.h"
#include "twobp/plan/cost_source.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/record.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/synthesize.h"
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
  double action_ms = 0;    // a fixed cost of every compute action, on top of the chunk's share (CostModel::per_action)
  // synth (twobp/schedule/synthesize.h): its v's (empty: as every schedule), budget and search effort.
  std::vector<int> synth_chunks;
  int synth_memory = 0;  // activations per rank in a whole rank's micro-batches (0: 1F1B's, min(p, m))
  double synth_work = 20e6;
};

// The costs of the command line (per rank; --w-batched: W's line through one and K micro-batches,
// fit_weight_cost), or result --result of the --from-json run document (twobp/plan/cost_source.h).
CostSource load_costs(const SimulateArgs& a) {
  if (!a.from_json.empty()) {
    try {
      return CostSource(read_run_document_file(a.from_json), static_cast<std::size_t>(a.result), a.from_json,
                        a.overlap);
    } catch (const UsageError& e) {  // the message names the file and result; the option too
      throw UsageError(fmt::format("--from-json: {}", e.what()));
    }
  }
  // A B's weight part is a W of one micro-batch: B = I + W by default, --w-batched or not.
  RankCosts c{a.f, a.i, a.w, a.b >= 0 ? a.b : a.i + a.w, 0.0, a.comm};
  if (!a.w_batched.empty()) {
    const int k = static_cast<int>(a.w_batched[0]);
    if (k < 2 || static_cast<double>(k) != a.w_batched[0]) {
      throw UsageError(fmt::format("--w-batched {} {}: the micro-batch count must be an integer >= 2",
                                   a.w_batched[0], a.w_batched[1]));
    }
    const WeightCost w = fit_weight_cost({{1, {a.w}}, {k, {a.w_batched[1]}}});
    c.backward_weight = w.per_micro_batch;
    c.backward_weight_fixed = w.fixed;
  }
  try {
    return CostSource(c, std::max(a.overlap, 0.0));
  } catch (const UsageError& e) {  // the library's rule (e.g. B below max(I, W)), told in the options' names
    throw UsageError(fmt::format("--f --i --w --b --w-batched --comm: {}", e.what()));
  }
}

// What load_costs' costs are, for the output: where they come from, and --w-batched's fit.
std::string describe(const SimulateArgs& a, const CostSource& src) {
  const std::string fixed = a.action_ms > 0 ? fmt::format(", + {:g} ms per action (--action-ms)", a.action_ms) : "";
  if (src.measured()) return src.description() + fixed;
  std::string out = "command line, " + src.description() + (a.b < 0 ? " (B=I+W)" : "");
  if (!a.w_batched.empty()) {
    out += fmt::format(" (a W of 1 micro-batch {} ms, of {} {} ms: W0 + W per micro-batch)", a.w, a.w_batched[0],
                       a.w_batched[1]);
  }
  return out + fixed;
}

// The costs of `sched`'s stages (CostSource::costs_for), each action also paying --action-ms
// (CostModel::per_action): the one place this program builds a cost model, for every row, 1F1B standard's
// reference and synth's search alike.
CostModel costs_of(const SimulateArgs& a, const CostSource& src, const Schedule& sched, std::string* rule = nullptr) {
  CostModel costs = src.costs_for(sched, a.recompute, rule);
  costs.per_action = a.action_ms;
  return costs;
}

// --dp's all-reduces added to `costs`: the model's parameters split evenly over the stages, on a ring of
// --link-gbps (add_data_parallel). Returns the largest rank's total (dp_reduce_ms).
double add_dp(const SimulateArgs& a, const Schedule& sched, bool overlap, CostModel& costs) {
  const std::vector<double> bytes(sched.num_stages, a.model_params / sched.num_stages * a.grad_bytes);
  return add_data_parallel(costs, sched, bytes,
                           RingLink{a.dp, a.link_gbps * 1e9 / 8, a.link_latency_us * 1e-6, a.dp_buckets, overlap});
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
  double vs_standard = 0;       // 2bp rows: the standard row's step (same schedule, v, overlap) / this step
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
    return costs_of(a, src, shape);
  };
  SynthesisOptions search;
  search.max_work = static_cast<std::int64_t>(a.synth_work);
  return SynthesizedScheduleGenerator(costs, a.synth_memory, search).generate(options);
}

// 1F1B standard's step time (v = 1) under the same costs: the reference of the "vs 1f1b std" column.
double one_f_one_b_standard_ms(const SimulateArgs& a, const CostSource& src, bool overlap) {
  const Schedule sched = make_schedule("1f1b", ScheduleOptions{a.ranks, a.microbatches, 1, BackwardMode::kStandard});
  CostModel costs = costs_of(a, src, sched);
  if (a.dp > 1) add_dp(a, sched, overlap, costs);
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
    make_directories(a.dump_schedules);
    const std::string base = fmt::format("{}/{}_{}_p{}_m{}_v{}", a.dump_schedules, name, to_string(mode),
                                         sched.num_ranks, sched.num_micro_batches, sched.num_stages / sched.num_ranks);
    save_schedule_file(base + ".txt", sched);
    save_schedule_file(base + ".csv", sched);
  }
  row.v = sched.num_stages / sched.num_ranks;
  row.stages = sched.num_stages;
  for (std::size_t k = 0; k < plan.overlaps.size(); ++k) {
    const bool overlap = plan.overlaps[k];
    CostModel costs = costs_of(a, src, sched, &row.rule);
    if (a.dp > 1) row.dp_reduce_ms = add_dp(a, sched, overlap, costs);
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
  // A progress line on stderr at most every 2 s (64 ranks take tens of seconds; small runs print none).
  const auto started = std::chrono::steady_clock::now();
  auto last_line = started;
  for (std::size_t k = 0; k < plan.names.size(); ++k) {
    const std::string& name = plan.names[k];
    const auto now = std::chrono::steady_clock::now();
    if (now - last_line >= std::chrono::seconds(2)) {
      std::cerr << "simulate: "
                << metrics::format_progress("schedule", static_cast<int>(k) + 1, static_cast<int>(plan.names.size()),
                                            std::chrono::duration<double>(now - started).count())
                << " (" << name << ")\n";
      last_line = now;
    }
    const std::vector<int> counts = a.schedule_file.empty()
                                        ? chunk_counts(a, name)
                                        : std::vector<int>{plan.from_file.num_stages / plan.from_file.num_ranks};
    for (int v : counts) {
      for (BackwardMode mode : plan.modes) simulate_one(a, src, plan, name, v, mode, reference, rows, rejected);
    }
  }
}

// The outputs of a result, in the order of its JSON object.
Reporter<SimRow> result_reporter(const SimulateArgs& a) {
  using Row = SimRow;
  std::vector<Column<Row>> cols;
  auto add = [&](auto&&... args) { cols.push_back(column<Row>(std::forward<decltype(args)>(args)...)); };
  auto add_if = [&](auto&&... args) { cols.push_back(column_if<Row>(std::forward<decltype(args)>(args)...)); };
  add("schedule", [](const Row& r) { return r.schedule; });
  add("mode", [](const Row& r) { return to_string(r.mode); });
  add("p", [](const Row& r) { return r.p; });
  add("m", [](const Row& r) { return r.m; });
  add("v", [](const Row& r) { return r.v; });
  add("stages", [](const Row& r) { return r.stages; });
  add("sim_step_ms", [](const Row& r) { return r.step; });
  add("sim_bubble_fraction", [](const Row& r) { return r.bubble; });
  add("peak_live_microbatches", [](const Row& r) { return r.peak_live; });
  add("cost_rule", [](const Row& r) { return r.rule; });
  add("generate_ms", [](const Row& r) { return r.generate_ms; });
  add("simulate_ms", [](const Row& r) { return r.simulate_ms; });
  add_if("speedup_vs_1f1b_standard", [](const Row& r) { return r.vs_1f1b_standard > 0; },
         [](const Row& r) { return r.vs_1f1b_standard; });
  if (a.dp > 1) {
    const int dp = a.dp;
    add("dp", [dp](const Row&) { return dp; });
    add("dp_overlap", [](const Row& r) { return r.dp_overlap; });
    add("dp_reduce_ms", [](const Row& r) { return r.dp_reduce_ms; });
    add("dp_exposed_ms", [](const Row& r) { return r.dp_exposed_ms; });
  }
  add_if("speedup_vs_standard", [](const Row& r) { return r.vs_standard > 0; },
         [](const Row& r) { return r.vs_standard; });
  return Reporter<Row>(std::move(cols), {});
}

// {"config", "results" (one per schedule × mode × overlap), "rejected", "tool_ms"}.
Json simulate_json(const SimulateArgs& a, const CostSource& src, const std::vector<SimRow>& rows,
                   const std::vector<Rejected>& rejected, double total_ms) {
  Json out;
  out["config"] = {{"ranks", a.ranks},     {"microbatches", a.microbatches}, {"chunks_per_rank", a.chunks_per_rank},
                   {"costs", describe(a, src)}, {"communication_ms", src.rank_costs().communication},
                   {"recompute", a.recompute}, {"action_ms", a.action_ms}};
  const RankCosts& c = src.rank_costs();
  if (src.overlap() > 0) out["config"]["overlap"] = src.overlap();
  if (!src.measured()) {
    out["config"]["costs_ms_per_rank"] = {
        {"F", c.forward}, {"I", c.backward_input}, {"W", c.backward_weight}, {"B", c.backward}};
    if (c.backward_weight_fixed > 0) out["config"]["costs_ms_per_rank"]["W0"] = c.backward_weight_fixed;
  }
  if (a.dp > 1) {
    out["config"]["data_parallel"] = {{"dp", a.dp},           {"link_gbps", a.link_gbps},
                                      {"link_latency_us", a.link_latency_us}, {"model_params", a.model_params},
                                      {"grad_bytes", a.grad_bytes}, {"overlap", a.dp_overlap},
                                      {"buckets_per_stage", a.dp_buckets}};
  }
  const Reporter<SimRow> reporter = result_reporter(a);
  out["results"] = Json::array();
  for (const SimRow& r : rows) out["results"].push_back(reporter.json(r));
  out["rejected"] = Json::array();
  for (const auto& r : rejected) {
    out["rejected"].push_back({{"schedule", r.schedule}, {"v", r.v}, {"reason", r.reason}});
  }
  out["tool_ms"] = total_ms;
  return out;
}

// One table line: a schedule's v and overlap setting, its standard (s) and 2bp (t) rows side by side.
struct SimLine {
  const SimRow *s = nullptr, *t = nullptr;
  const SimRow& any() const { return s ? *s : *t; }
};

// The table's columns (a table-only Reporter: its lines have no JSON).
Reporter<SimLine> table_reporter(const SimulateArgs& a) {
  using Line = SimLine;
  std::vector<Column<Line>> cols;
  auto add = [&](const std::string& header, std::function<std::string(const Line&)> text) {
    cols.push_back(cell<Line>(header, std::move(text)));
  };
  // A number of the standard (s) or the 2bp (t) row; empty without that row.
  auto of = [](const SimRow* Line::*row, double SimRow::*field, int digits) {
    return [row, field, digits](const Line& l) { return l.*row ? fmt_num(l.*row->*field, digits) : std::string(); };
  };
  auto peak = [](const SimRow* Line::*row) {
    return [row](const Line& l) { return l.*row ? std::to_string((l.*row)->peak_live) : std::string(); };
  };
  add("schedule", [](const Line& l) { return l.any().schedule; });
  if (a.dp > 1) add("dp overlap", [](const Line& l) { return std::string(l.any().dp_overlap ? "on" : "off"); });
  add("v", [](const Line& l) { return std::to_string(l.any().v); });
  add("stages", [](const Line& l) { return std::to_string(l.any().stages); });
  add("std ms", of(&Line::s, &SimRow::step, 2));
  add("2bp ms", of(&Line::t, &SimRow::step, 2));
  add("speedup", [](const Line& l) { return l.s && l.t ? fmt_num(l.s->step / l.t->step, 3) : ""; });
  add("2bp vs 1f1b std",
       [](const Line& l) { return l.t && l.t->vs_1f1b_standard > 0 ? fmt_num(l.t->vs_1f1b_standard, 3) : ""; });
  add("std bubble", of(&Line::s, &SimRow::bubble, 3));
  add("2bp bubble", of(&Line::t, &SimRow::bubble, 3));
  add("std peak mbs", peak(&Line::s));
  add("2bp peak mbs", peak(&Line::t));
  add("cost rule", [](const Line& l) { return l.any().rule; });
  add("tool ms", [](const Line& l) {
    double ms = 0;
    for (const SimRow* r : {l.s, l.t}) ms += r ? r->generate_ms + r->simulate_ms : 0;
    return fmt_num(ms, 0);
  });
  if (a.dp > 1) {
    add("dp reduce ms", [](const Line& l) { return fmt_num(l.any().dp_reduce_ms, 2); });
    add("std exposed", of(&Line::s, &SimRow::dp_exposed_ms, 2));
    add("2bp exposed", of(&Line::t, &SimRow::dp_exposed_ms, 2));
  }
  return Reporter<Line>(std::move(cols));
}

// The table's lines: per (schedule, v) in the order simulated (synth: several v), per overlap setting.
std::vector<SimLine> simulate_lines(const SimulatePlan& plan, const std::vector<SimRow>& rows) {
  std::vector<std::pair<std::string, int>> seen;
  std::vector<SimLine> lines;
  for (const auto& row : rows) {
    const std::pair<std::string, int> key{row.schedule, row.v};
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
    seen.push_back(key);
    for (bool overlap : plan.overlaps) {
      SimLine line;
      for (const auto& r : rows) {
        if (r.schedule == key.first && r.v == key.second && r.dp_overlap == overlap) {
          (r.mode == BackwardMode::kStandard ? line.s : line.t) = &r;
        }
      }
      if (line.s || line.t) lines.push_back(line);
    }
  }
  return lines;
}

// Each 2bp row against the standard row of the same schedule, v and overlap.
void pair_rows(std::vector<SimRow>& rows) {
  for (SimRow& r : rows) {
    for (const SimRow& o : rows) {
      if (r.mode == BackwardMode::kSplit && o.mode == BackwardMode::kStandard && o.schedule == r.schedule &&
          o.v == r.v && o.dp_overlap == r.dp_overlap) {
        r.vs_standard = o.step / r.step;
        break;
      }
    }
  }
}

void run_simulate(const SimulateArgs& a) {
  const CostSource src = load_costs(a);
  const SimulatePlan plan = simulate_plan(a);
  const auto t_all = std::chrono::steady_clock::now();
  std::vector<SimRow> rows;
  std::vector<Rejected> rejected;
  simulate_all(a, src, plan, rows, rejected);
  pair_rows(rows);
  const double total_ms = ms_since(t_all);
  const Json out = simulate_json(a, src, rows, rejected, total_ms);

  // A schedule file decides p and m (--ranks and --microbatches do not apply to it).
  std::cout << fmt::format("simulate: {}; costs: {}\n",
                           a.schedule_file.empty() ? fmt::format("p={} m={}", a.ranks, a.microbatches)
                                                   : fmt::format("{} (p={} m={})", a.schedule_file,
                                                                 plan.from_file.num_ranks,
                                                                 plan.from_file.num_micro_batches),
                           describe(a, src));
  if (a.dp > 1) {
    std::cout << fmt::format("data parallel: dp={}, {:g} parameters split evenly over the stages, {:g} bytes per "
                             "gradient, ring all-reduce on {:g} Gbit/s with {:g} us per step\n",
                             a.dp, a.model_params, a.grad_bytes, a.link_gbps, a.link_latency_us);
  }
  print_table(std::cout, table_reporter(a).table(simulate_lines(plan, rows)));
  for (const auto& r : rejected) std::cout << fmt::format("rejected: {} (v={}): {}\n", r.schedule, r.v, r.reason);
  std::cout << fmt::format("generated, validated and simulated {} configurations in {:.0f} ms\n", rows.size(),
                           total_ms);
  if (!a.dump_schedules.empty()) {
    std::cout << fmt::format("wrote {} schedules to {}/ (text form .txt and PyTorch's .csv)\n",
                             rows.size() / std::max<std::size_t>(1, plan.overlaps.size()), a.dump_schedules);
  }
  if (!a.json.empty()) {
    cli::write_json(a.json, out);
    std::cout << "wrote " << a.json << "\n";
  }
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto a = std::make_shared<SimulateArgs>();
  CLI::App* sub = app.add_subcommand(
      "simulate", "Predicted step time, bubble and memory of every schedule, 2BP vs standard, from stage costs");
  auto* f = count_option(sub, "--f", a->f, "Forward cost per rank (per stage at v=1), ms", 0, 1e9);
  auto* i = count_option(sub, "--i", a->i, "Input-gradient (2BP stage 1) cost per rank, ms", 0, 1e9);
  auto* w = count_option(sub, "--w", a->w, "Weight-gradient (2BP stage 2) cost per rank and micro-batch, ms", 0, 1e9);
  auto* b = sub->add_option("--b", a->b, "Fused backward cost per rank, ms (default: I + W)")
                ->check(cli::number_in(0, 1e9));
  auto* w_batched =
      sub->add_option("--w-batched", a->w_batched,
                      "K MS: a W of K micro-batches at once costs MS per rank (e.g. `split --batched-w`'s "
                      "batched_w_ms); with --w, one micro-batch's, each W then costs a fixed part + K x per "
                      "micro-batch (the line through the two, twobp::fit_weight_cost)")
          ->expected(2)->check(cli::number_in(0, 1e9));
  auto* comm = count_option(sub, "--comm", a->comm, "One-way latency of one activation or gradient, ms", 0, 1e9);
  auto* from = sub->add_option("--from-json", a->from_json, "Take costs from a `twobp_bench pipeline` JSON")
                   ->check(cli::regular_file());
  for (auto* opt : {f, i, w, b, comm, w_batched}) from->excludes(opt);
  sub->add_option("--overlap", a->overlap,
                  "Overlapped F&B pairs (DualPipeV's) run at once, hiding this share of the shorter part "
                  "(CostModel::overlap; 0: in order, as without an overlap hook). Default: 0, or what the "
                  "--from-json run's pairs hid")
      ->check(cli::number_in(0, 1));
  count_option(sub, "--action-ms", a->action_ms,
               "A fixed cost of every compute action (F, I, W, B), ms, added on top of each chunk's share of the "
               "costs: a chunk of v costs F / v + this (CostModel::per_action; a W of several micro-batches pays it "
               "once). Measured: `twobp_bench split` at two --layers, or a fitted partition's per-action term",
               0, 1e9);
  count_option(sub, "--result", a->result, "Which result of --from-json (index into \"results\")", 0)->needs(from);
  count_option(sub, "--ranks", a->ranks, "p: ranks", 1, 64);
  count_option(sub, "--microbatches,--micro-batches", a->microbatches, "m: micro-batches per step", 1, 256);
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
  count_option(sub, "--link-gbps", a->link_gbps, "Data-parallel link bandwidth of one rank, gigabit/s", 1e-3, 1e6);
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
