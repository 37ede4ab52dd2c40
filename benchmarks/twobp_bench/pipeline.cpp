// `twobp_bench pipeline`: training-step throughput of whole pipelines, 2BP against standard backprop, with the
// measured bubble and the simulator's prediction from costs measured in the same run.
//
//   mpirun -np 2 build/benchmarks/twobp_bench pipeline --schedule 1f1b --microbatches 2 --json FILE
//   mpirun -np 4 build/benchmarks/twobp_bench pipeline --dp 2 --schedule 1f1b,zb-v   (2 replicas of 2 ranks)
//   build/benchmarks/twobp_bench pipeline --ranks 2 --schedule all ...     (ranks as threads, Local transport)
//
// docs/BENCHMARKS.md ("pipeline") defines every metric, variant (--dp, --variable-seq, --memory-limit-mb,
// --recompute) and output; the formulas are library code (twobp/metrics/, twobp/plan/measure.h). Its JSON is a run
// document (twobp/plan/record.h). Step times are taken between barriers over the whole world; costs, bubble,
// traces and the simulation are per pipeline (replica 0's).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <numeric>

#include "bench_common.h"
#include "commands.h"
#include "pipeline_models.h"
#include "twobp/config.h"
#include "twobp/files.h"
#include "twobp/metrics/energy.h"
#include "twobp/metrics/memory.h"
#include "twobp/metrics/metrics.h"
#include "twobp/metrics/step_log.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/recompute.h"
#include "twobp/plan/record.h"
#include "twobp/plan/step_meter.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/interrupt.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/mpi_launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/trace/attribution.h"
#include "twobp/trace/chart.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/collectives.h"
#include "twobp/transport/local.h"
#include "twobp/transport/mpi.h"
#include "twobp_cli.h"

namespace twobp::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

struct PipelineArgs {
  std::string schedule = "1f1b";
  std::string mode = "both";
  int ranks = 2;  // pipeline ranks p (threads: dp · p threads run; under a launcher p = world / dp)
  int dp = 1;     // data-parallel replicas of the pipeline
  int microbatches = 2;
  int chunks_per_rank = 0;  // 0: the schedule's default
  std::string schedule_file;  // overrides --schedule; its own mode
  PipelineModelArgs model;  // --model and its dimensions
  int steps = 10;
  int warmup = 3;
  int threads = 1;
  double timeout_s = 300;
  bool variable_seq = false;  // also run every configuration with announced shapes (see the header)
  bool recompute = false;     // activation recomputation on every stage
  int recompute_ranks = 0;    // with recompute: only on the stages of pipeline ranks below this (0: every rank)
  std::string recompute_on;   // with recompute: only on the stages of these pipeline ranks ("0-1,3"; "": as above)
  double memory_limit_mb = 0;  // > 0: also run every configuration under this memory limit (see the header)
  std::string powercap_root = energy::EnergyOptions{}.powercap_root;
  std::string json, csv, trace_dir, chart;
};

// When a data-parallel run starts its gradient buckets (DataParallelOptions::overlap, start_during_backward).
struct DpBuckets {
  bool overlap = true;
  bool during_backward = true;
  const char* name() const {
    return !overlap ? "after_step" : during_backward ? "during_backward" : "after_backward";
  }
};

struct RunResult {
  std::string schedule;
  BackwardMode mode;
  int p = 0, m = 0, v = 0;
  Summary step_ms;
  double samples_per_s = 0, tokens_per_s = 0, bubble = 0, sim_step_ms = 0, sim_bubble = 0, comm_ms = 0;
  int peak_live = 0;
  double peak_rss = 0;
  // Data parallelism (dp > 1 only; see the header comment).
  int dp = 1;
  bool dp_overlap = true;
  bool dp_after_backward = false;  // standard mode: buckets started after the stage's last B
  bool announced = false;  // shapes announced by senders (no activation spec)
  double announce_ratio = 0;  // announced rows of --variable-seq: see the header
  double dp_exposed_ms = 0, dp_reduce_bytes = 0;
  // Tensor memory (see the header): per pipeline rank, and the maxima over ranks.
  std::vector<double> peak_memory_per_rank, sim_peak_memory_per_rank;
  double peak_memory = 0, sim_peak_memory = 0;
  // Per rank: what the step added at its peak beyond the memory held when it started and the gradients it
  // allocates (activations, deferred-W state, working memory): peak - base - gradient bytes, measured and simulated.
  std::vector<double> step_peak_per_rank, sim_step_peak_per_rank;
  int64_t memory_limit = 0;  // limited rows of --memory-limit-mb
  double limit_ratio = 0;
  std::optional<double> energy_j;  // per step, the whole job (see the header); nullopt: not measured
  MeasuredCosts costs;  // per stage, agreed over the pipeline (R only with --recompute); communication_ms
  std::vector<std::string> trace_files;        // written by rank 0 under --trace-dir
  std::vector<StepAttribution> attribution;    // per pipeline rank (replica 0's), the mean over measured steps
};

const char* dp_buckets_name(const RunResult& r) {
  return DpBuckets{r.dp_overlap, !r.dp_after_backward}.name();
}

double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}

// One pipeline of a configuration: how its shapes travel and its memory limit (0: none).
struct Variant {
  bool announced = false;
  int64_t memory_limit = 0;
};

// One variant's pipeline and its measured steps.
struct Measurements {
  std::unique_ptr<Pipeline> pipeline;
  Variant variant;
  std::unique_ptr<StepMeter> meter;
};

RunResult summarize_run(Transport& world, ParallelGroups& groups, const PipelineArgs& a, const std::string& name,
                        BackwardMode mode, const DpBuckets& buckets, double comm_ms, const Measurements& m);

// Runs one configuration on this rank; every rank calls it with the same arguments, in the same order. One result
// per entry of `variants` (fixed activation specs or shapes announced by the senders; a memory limit or none): the
// variants are separate pipelines of identical models that take turns step by step, so that the machine's noise
// hits them alike and their ratio is paired (the second against the first).
// `world` holds every rank (dp · p); the pipeline runs on groups.pipeline(), and with dp > 1 averages its
// gradients over groups.data_parallel() (when the buckets start: `buckets`). The steps are measured by a
// StepMeter (twobp/plan/step_meter.h): step times between barriers over the world, the rest per pipeline
// (replica 0's reported). With dp == 1 the world is the pipeline.
std::vector<RunResult> run_config(Transport& world, ParallelGroups& groups, const PipelineArgs& a,
                                  const std::string& name, BackwardMode mode, const DpBuckets& buckets,
                                  const std::vector<Variant>& variant_list, energy::RankEnergy& rank_energy) {
  const Duration timeout{static_cast<int64_t>(a.timeout_s * 1000)};
  Transport& transport = groups.pipeline();
  const int p = transport.world_size(), me = transport.rank();
  Schedule schedule = resolve_schedule({name, a.schedule_file, a.chunks_per_rank}, p, a.microbatches, mode);

  std::vector<Measurements> variants(variant_list.size());
  const PipelineModelArgs model = a.model;
  const std::vector<int> recomputing =
      recomputing_ranks(a.recompute, a.recompute_ranks, a.recompute_on, schedule.num_ranks);
  for (std::size_t k = 0; k < variant_list.size(); ++k) {
    const Variant& vk = variant_list[k];
    PipelineOptions options;
    options.executor.timeout = timeout;
    options.loss = model_loss(a.model);
    if (!vk.announced) {
      options.executor.activation_spec = [model](int stage) { return model_activation_spec(model, stage); };
    }
    options.data_parallel.group = groups.data_parallel();
    options.data_parallel.overlap = buckets.overlap;
    options.data_parallel.start_during_backward = buckets.during_backward;
    options.executor.record_memory = true;
    options.executor.memory_limit_bytes = vk.memory_limit;
    variants[k].variant = vk;
    std::vector<PipelineChunk> chunks = make_model_chunks(a.model, schedule, me);
    for (auto& chunk : chunks) chunk.recompute = has_rank(recomputing, schedule.stage_to_rank[chunk.stage]);
    variants[k].pipeline = std::make_unique<Pipeline>(schedule, std::move(chunks), transport, options);
    variants[k].meter = std::make_unique<StepMeter>(*variants[k].pipeline, world,
                                                    StepMeterOptions{timeout, &rank_energy});
  }
  const int64_t batch = static_cast<int64_t>(a.microbatches) * a.model.micro_batch_size;
  // Each replica trains on its own share of the global batch: the same synthetic generator, seeded 7 + replica
  // (replica 0, and dp = 1, get seed 7 as before data parallelism).
  const auto [inputs, targets] =
      make_model_batch(a.model, batch, /*seed=*/7 + static_cast<uint64_t>(groups.replica()));
  const double comm_ms =
      measure_message_ms(transport, at::empty(model_activation_spec(a.model, 0).shape), timeout);
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    for (Measurements& v : variants) v.meter->step(inputs, targets, /*record=*/step >= a.warmup);
  }

  std::vector<RunResult> out;
  for (const Measurements& v : variants) {
    out.push_back(summarize_run(world, groups, a, name, mode, buckets, comm_ms, v));
  }
  // The second variant against the first, paired: the median over measured steps of the ratio of the two
  // variants' step times in that step (rank 0's times, as every reported step time).
  if (variants.size() == 2) {
    std::vector<double> ratios;
    for (int k = 0; k < variants[0].meter->steps(); ++k) {
      ratios.push_back(variants[0].meter->step_ms()[k] / variants[1].meter->step_ms()[k]);
    }
    (variant_list[1].announced ? out[1].announce_ratio : out[1].limit_ratio) = summarize(ratios).median;
  }
  return out;
}

// Rank 0 of the world, --trace-dir: the last measured step's Chrome trace and timeline, and where each rank's time
// went; returns the files.
std::vector<std::string> write_traces(const PipelineArgs& a, const RunResult& r, const Variant& variant,
                                      const MeteredSteps& s) {
  make_directories(a.trace_dir);
  std::string base = fmt::format("{}/{}_{}_p{}_m{}", a.trace_dir, r.schedule, to_string(r.mode), r.p, r.m);
  if (r.dp > 1) {
    base += fmt::format("_dp{}_{}", r.dp,
                        r.dp_overlap ? (r.dp_after_backward ? "overlap_after_b" : "overlap") : "nooverlap");
  }
  if (variant.announced) base += "_announced";
  if (variant.memory_limit > 0) base += "_limited";
  const std::string what = fmt::format("{} {} — p={} m={} v={}", r.schedule, to_string(r.mode), r.p, r.m, r.v);
  write_file(base + ".trace.json", to_chrome_trace(s.last_traces), "--trace-dir");
  write_file(base + ".svg", to_svg(s.last_traces, what + ", last measured step"), "--trace-dir");
  write_file(base + ".attribution.svg",
             to_attribution_svg(s.attribution, fmt::format("{}: where each rank's step went (mean of {} steps)", what,
                                                           s.steps)),
             "--trace-dir");
  return {base + ".trace.json", base + ".svg", base + ".attribution.svg"};
}

// The results of one variant of run_config (one Measurements): per-stage costs, bubble, throughput, data-parallel
// waits, memory, the simulation of the measured costs and (rank 0, --trace-dir) the trace of the last measured
// step. Collective over the world, like run_config.
RunResult summarize_run(Transport& world, ParallelGroups& groups, const PipelineArgs& a, const std::string& name,
                        BackwardMode mode, const DpBuckets& buckets, double comm_ms, const Measurements& m) {
  const Duration timeout{static_cast<int64_t>(a.timeout_s * 1000)};
  Transport& transport = groups.pipeline();
  const Schedule& sched = m.pipeline->schedule();
  MeteredSteps s = m.meter->summarize(groups);
  RunResult r;
  r.schedule = name;
  r.mode = mode;
  r.p = transport.world_size();
  r.m = a.microbatches;
  r.v = sched.num_stages / sched.num_ranks;
  r.dp = groups.layout().dp;
  r.dp_overlap = buckets.overlap;
  r.dp_after_backward = buckets.overlap && !buckets.during_backward;
  r.announced = m.variant.announced;
  r.memory_limit = m.variant.memory_limit;
  r.costs = s.costs;
  r.costs.communication = comm_ms;
  r.step_ms = summarize(s.step_ms);
  r.bubble = summarize(s.bubble).median;
  // Samples of the global batch: dp replicas of m micro-batches each.
  const double samples = static_cast<double>(r.dp) * a.microbatches * static_cast<double>(a.model.micro_batch_size);
  r.samples_per_s = metrics::per_second(samples, r.step_ms.median / 1000.0);
  r.tokens_per_s = metrics::tokens_per_s(r.samples_per_s, tokens_per_sample(a.model));
  // Per rank its share of its process's peak resident set (rank threads share one process): the largest.
  r.peak_rss = max_over_ranks(
      world, metrics::memory_per_rank(peak_rss_bytes(), transport.name() == "local" ? world.world_size() : 1),
      timeout);
  r.energy_j = s.energy_j;
  if (r.dp > 1) {
    // The gradient bytes of replica 0's ranks (its stages' .grad bytes, twobp/plan/measure.h, each tensor once).
    r.dp_exposed_ms = summarize(s.exposed_reduce_ms).median;
    const std::vector<double> per_stage =
        groups.replica() == 0 ? stage_gradient_bytes(*m.pipeline) : std::vector<double>{};
    r.dp_reduce_bytes = sum_over_ranks(world, {std::accumulate(per_stage.begin(), per_stage.end(), 0.0)}, timeout)[0];
  }
  const SimulationResult sim = simulate(sched, r.costs.cost_model(mode));
  r.sim_step_ms = sim.step_time;
  r.sim_bubble = sim.bubble_fraction;
  r.peak_live = *std::max_element(sim.peak_live_micro_batches.begin(), sim.peak_live_micro_batches.end());
  // Tensor memory (see the header): the measured peak per pipeline rank, and the peak the memory model measured
  // in the same steps predicts (compare_peak_memory).
  PeakMemory& c = *s.memory;
  r.peak_memory = *std::max_element(c.measured.begin(), c.measured.end());
  r.sim_peak_memory = *std::max_element(c.predicted.begin(), c.predicted.end());
  r.peak_memory_per_rank = std::move(c.measured);
  r.sim_peak_memory_per_rank = std::move(c.predicted);
  r.step_peak_per_rank = std::move(c.measured_step);
  r.sim_step_peak_per_rank = std::move(c.predicted_step);
  r.attribution = s.attribution;
  if (world.rank() == 0 && !a.trace_dir.empty()) r.trace_files = write_traces(a, r, m.variant, s);
  return r;
}

// "2bp ×1.234" labels and tokens/s (or samples/s) bars per schedule.
void write_chart(const PipelineArgs& a, const std::vector<RunResult>& results, bool tokens) {
  std::vector<BarGroup> groups;
  int p = 0;
  for (const auto& r : results) {
    p = r.p;
    std::string name = fmt::format("{} (v={})", r.schedule, r.v);
    if (r.dp > 1) {
      name += r.dp_overlap ? (r.dp_after_backward ? " dp overlap after B" : " dp overlap") : " dp no overlap";
    }
    if (r.announced) name += " announced";
    auto it = std::find_if(groups.begin(), groups.end(), [&](const BarGroup& g) { return g.name == name; });
    if (it == groups.end()) {
      groups.push_back({name, {0.0, 0.0}, ""});
      it = groups.end() - 1;
    }
    it->values[r.mode == BackwardMode::kSplit ? 1 : 0] = tokens ? r.tokens_per_s : r.samples_per_s;
  }
  for (auto& g : groups) {
    if (g.values[0] > 0 && g.values[1] > 0) {
      g.label = fmt::format("{} \u00d7{:.3f}", to_string(BackwardMode::kSplit), g.values[1] / g.values[0]);
    }
  }
  std::string title = fmt::format("twobp pipeline throughput: {} model, p={}, m={}, micro-batch {}", a.model.model, p,
                                  a.microbatches, a.model.micro_batch_size);
  if (a.dp > 1) title += fmt::format(", dp={} (global batch)", a.dp);
  write_file(a.chart,
             bar_chart_svg(title, tokens ? "tokens/s" : "samples/s",
                           {to_string(BackwardMode::kStandard), to_string(BackwardMode::kSplit)}, groups),
             "--chart");
}

// One result with what the report derives from it and its standard-mode partner (same schedule, p, m, v, dp
// overlap, shapes and limit).
struct ResultRow {
  const RunResult* r = nullptr;
  double speedup = 0, sim_speedup = 0;  // vs the standard partner (0: none)
  double speedup_after_backward = 0;    // 2bp vs the standard partner whose dp buckets start after its last B
  std::optional<double> j_per_item;     // energy per token (resnet: per sample); nullopt: not measured
  std::optional<double> energy_ratio;   // j_per_item(standard) / j_per_item(2bp)
  double sim_error = 0;
  bool held = false;  // peak memory within the limit
};

std::vector<ResultRow> result_rows(const PipelineArgs& a, const std::vector<RunResult>& results, bool tokens) {
  auto per_item = [&](const RunResult& r) -> std::optional<double> {
    if (!r.energy_j) return std::nullopt;
    const double samples = static_cast<double>(r.dp) * r.m * static_cast<double>(a.model.micro_batch_size);
    return metrics::per_item(*r.energy_j,
                             tokens ? samples * static_cast<double>(tokens_per_sample(a.model)) : samples);
  };
  std::vector<ResultRow> rows;
  for (const RunResult& r : results) {
    ResultRow row;
    row.r = &r;
    row.j_per_item = per_item(r);
    row.sim_error = r.step_ms.median / r.sim_step_ms - 1.0;
    row.held = r.peak_memory <= static_cast<double>(r.memory_limit);
    for (const RunResult& o : results) {
      const bool same = o.schedule == r.schedule && o.p == r.p && o.m == r.m && o.v == r.v &&
                        o.dp_overlap == r.dp_overlap && o.announced == r.announced &&
                        o.memory_limit == r.memory_limit && o.mode == BackwardMode::kStandard;
      if (same && o.dp_after_backward && r.mode == BackwardMode::kSplit) {
        row.speedup_after_backward = r.samples_per_s / o.samples_per_s;
      }
      if (same && !o.dp_after_backward) {
        row.speedup = r.samples_per_s / o.samples_per_s;
        row.sim_speedup = o.sim_step_ms / r.sim_step_ms;
        const std::optional<double> other = per_item(o);
        if (r.mode == BackwardMode::kSplit && row.j_per_item && other && *row.j_per_item > 0) {
          row.energy_ratio = *other / *row.j_per_item;
        }
      }
    }
    rows.push_back(row);
  }
  return rows;
}

// The outputs of a result, in the order of its JSON object and CSV row.
std::vector<Column<ResultRow>> result_columns(const PipelineArgs& a, bool tokens) {
  using Row = ResultRow;
  std::vector<Column<Row>> cols;
  auto add = [&](auto&&... args) { cols.push_back(column<Row>(std::forward<decltype(args)>(args)...)); };
  auto add_if = [&](auto&&... args) { cols.push_back(column_if<Row>(std::forward<decltype(args)>(args)...)); };
  add("schedule", [](const Row& r) { return r.r->schedule; }, "schedule", [](const Row& r) { return r.r->schedule; });
  add("mode", [](const Row& r) { return to_string(r.r->mode); }, "mode",
      [](const Row& r) { return std::string(to_string(r.r->mode)); });
  add("p", [](const Row& r) { return r.r->p; }, "p", [](const Row& r) { return std::to_string(r.r->p); });
  add("m", [](const Row& r) { return r.r->m; }, "m", [](const Row& r) { return std::to_string(r.r->m); });
  add("v", [](const Row& r) { return r.r->v; }, "v", [](const Row& r) { return std::to_string(r.r->v); });
  if (tokens) {
    add("tokens_per_s", [](const Row& r) { return r.r->tokens_per_s; }, "tokens/s",
        [](const Row& r) { return fmt_num(r.r->tokens_per_s, 0); });
  }
  add("samples_per_s", [](const Row& r) { return r.r->samples_per_s; }, tokens ? "" : "samples/s",
      [](const Row& r) { return fmt_num(r.r->samples_per_s, 1); });
  add("step_ms_median", [](const Row& r) { return r.r->step_ms.median; }, "step ms",
      [](const Row& r) { return fmt_num(r.r->step_ms.median, 1); });
  add("step_ms", [](const Row& r) { return to_json(r.r->step_ms); }, "p25-p75",
      [](const Row& r) { return fmt_num(r.r->step_ms.p25, 1) + "-" + fmt_num(r.r->step_ms.p75, 1); }, false);
  add("bubble_fraction", [](const Row& r) { return r.r->bubble; }, "bubble",
      [](const Row& r) { return fmt_num(r.r->bubble, 3); });
  add("sim_step_ms", [](const Row& r) { return r.r->sim_step_ms; }, "sim ms",
      [](const Row& r) { return fmt_num(r.r->sim_step_ms, 1); });
  add("sim_bubble_fraction", [](const Row& r) { return r.r->sim_bubble; });
  add("sim_error", [](const Row& r) { return r.sim_error; }, "sim err",
      [](const Row& r) { return fmt_num(100 * r.sim_error, 1) + "%"; });
  add("peak_live_microbatches", [](const Row& r) { return r.r->peak_live; }, "peak mbs",
      [](const Row& r) { return std::to_string(r.r->peak_live); });
  add("peak_rss_bytes", [](const Row& r) { return r.r->peak_rss; });
  add("peak_memory_bytes", [](const Row& r) { return r.r->peak_memory; }, "peak MiB",
      [](const Row& r) { return fmt_num(r.r->peak_memory / kMiB, 2); });
  add("peak_memory_bytes_per_rank", [](const Row& r) { return r.r->peak_memory_per_rank; }, "", nullptr, false);
  add("step_peak_bytes_per_rank", [](const Row& r) { return r.r->step_peak_per_rank; }, "", nullptr, false);
  // The simulator does not model the W's a memory limit moves: no simulated memory on limited rows.
  auto unlimited = [](const Row& r) { return r.r->memory_limit == 0; };
  add_if("sim_peak_memory_bytes", unlimited, [](const Row& r) { return r.r->sim_peak_memory; }, "sim MiB",
         [](const Row& r) { return r.r->memory_limit == 0 ? fmt_num(r.r->sim_peak_memory / kMiB, 2) : ""; });
  add_if("sim_memory_error", unlimited, [](const Row& r) {
    return r.r->sim_peak_memory > 0 ? r.r->peak_memory / r.r->sim_peak_memory - 1.0 : 0.0;
  });
  add_if("sim_peak_memory_bytes_per_rank", unlimited, [](const Row& r) { return r.r->sim_peak_memory_per_rank; },
         "", nullptr, false);
  add_if("sim_step_peak_bytes_per_rank", unlimited, [](const Row& r) { return r.r->sim_step_peak_per_rank; }, "",
         nullptr, false);
  if (a.memory_limit_mb > 0) {
    auto limited = [](const Row& r) { return r.r->memory_limit > 0; };
    add_if("memory_limit_bytes", limited, [](const Row& r) { return r.r->memory_limit; }, "limit MiB",
           [](const Row& r) {
             return r.r->memory_limit > 0
                        ? fmt_num(static_cast<double>(r.r->memory_limit) / kMiB, 2) + (r.held ? "" : " (over)")
                        : "none";
           });
    add_if("limit_held", limited, [](const Row& r) { return r.held; });
    add_if("limit_ratio", [](const Row& r) { return r.r->memory_limit > 0 && r.r->limit_ratio > 0; },
           [](const Row& r) { return r.r->limit_ratio; }, "limit ratio",
           [](const Row& r) { return r.r->limit_ratio > 0 ? fmt_num(r.r->limit_ratio, 3) : ""; });
  }
  // The measured costs in their one JSON form (twobp/plan/measure.h): communication_ms, costs_ms.
  add("communication_ms", [](const Row& r) { return r.r->costs.communication; });
  add("costs_ms", [](const Row&) { return Json(nullptr); }, "", nullptr, false);  // its place: the record's
  if (a.dp > 1) {
    add("dp", [](const Row& r) { return r.r->dp; }, "dp", [](const Row& r) { return std::to_string(r.r->dp); });
    add("dp_overlap", [](const Row& r) { return r.r->dp_overlap; }, "dp overlap", [](const Row& r) {
      return std::string(r.r->dp_overlap ? (r.r->dp_after_backward ? "on, after B" : "on") : "off");
    });
    add("dp_buckets", [](const Row& r) { return dp_buckets_name(*r.r); });
    add("dp_exposed_ms", [](const Row& r) { return r.r->dp_exposed_ms; }, "dp exposed ms",
        [](const Row& r) { return fmt_num(r.r->dp_exposed_ms, 2); });
    add("dp_reduce_bytes", [](const Row& r) { return r.r->dp_reduce_bytes; });
  }
  if (a.variable_seq) {
    add("shapes", [](const Row& r) { return r.r->announced ? "announced" : "fixed"; }, "shapes",
        [](const Row& r) { return std::string(r.r->announced ? "announced" : "fixed"); });
    add_if("announce_ratio", [](const Row& r) { return r.r->announce_ratio > 0; },
           [](const Row& r) { return r.r->announce_ratio; }, "announce ratio",
           [](const Row& r) { return r.r->announce_ratio > 0 ? fmt_num(r.r->announce_ratio, 3) : ""; });
  }
  auto paired = [](const Row& r) { return r.speedup > 0; };
  add_if("speedup_vs_standard", paired, [](const Row& r) { return r.speedup; }, "speedup",
         [](const Row& r) { return r.speedup > 0 ? fmt_num(r.speedup, 3) : ""; });
  add_if("sim_speedup_vs_standard", paired, [](const Row& r) { return r.sim_speedup; }, "sim speedup",
         [](const Row& r) { return r.speedup > 0 ? fmt_num(r.sim_speedup, 3) : ""; });
  add_if("speedup_vs_standard_after_backward", [](const Row& r) { return r.speedup_after_backward > 0; },
         [](const Row& r) { return r.speedup_after_backward; });
  add("energy_j", [](const Row& r) { return r.r->energy_j ? Json(*r.r->energy_j) : Json(nullptr); });
  add(tokens ? "j_per_token" : "j_per_sample",
      [](const Row& r) { return r.j_per_item ? Json(*r.j_per_item) : Json(nullptr); }, tokens ? "J/token" : "J/sample",
      [](const Row& r) { return r.j_per_item ? fmt::format("{:.4g}", *r.j_per_item) : std::string("?"); });
  add_if("energy_ratio", [](const Row& r) { return r.energy_ratio.has_value(); },
         [](const Row& r) { return *r.energy_ratio; }, "J ratio",
         [](const Row& r) { return r.energy_ratio ? fmt_num(*r.energy_ratio, 3) : ""; });
  add("attribution", [](const Row& r) { return Json::parse(to_attribution_json(r.r->attribution)); }, "",
      nullptr, false);
  add_if("trace_files", [](const Row& r) { return !r.r->trace_files.empty(); },
         [](const Row& r) { return r.r->trace_files; }, "", nullptr, false);
  return cols;
}

// The table's columns (headers of result_columns), in table order. `energy`: some result has an energy measurement
// (the table shows energy columns only then).
std::vector<std::string> result_table(const PipelineArgs& a, bool tokens, bool energy) {
  std::vector<std::string> table{"schedule", "mode"};
  if (a.memory_limit_mb > 0) table.push_back("limit MiB");
  if (a.variable_seq) table.push_back("shapes");
  if (a.dp > 1) table.insert(table.end(), {"dp", "dp overlap"});
  table.insert(table.end(), {"p", "m", "v", "step ms", "p25-p75", tokens ? "tokens/s" : "samples/s", "speedup",
                             "sim speedup", "bubble", "sim ms", "sim err", "peak mbs", "peak MiB", "sim MiB"});
  if (a.dp > 1) table.push_back("dp exposed ms");
  if (a.variable_seq) table.push_back("announce ratio");
  if (a.memory_limit_mb > 0) table.push_back("limit ratio");
  if (energy) table.insert(table.end(), {tokens ? "J/token" : "J/sample", "J ratio"});
  return table;
}

// The run's configuration: model, measurement and what the optional outputs hold.
Json report_config(const PipelineArgs& a, const std::string& transport_name, bool energy,
                   const std::string& energy_source, const std::string& energy_note) {
  const auto& m = a.model;
  Json config = {{"model", m.model},       {"dim", m.dim},         {"layers", m.layers},
                 {"heads", m.heads},       {"kv_heads", m.kv_heads}, {"ffn", m.ffn},
                 {"vocab", m.vocab},       {"seq", m.seq},         {"micro_batch_size", m.micro_batch_size},
                 {"steps", a.steps},       {"warmup", a.warmup},   {"threads", a.threads},
                 {"transport", transport_name}, {"load_average", metrics::load_average()},
                 {"recompute", a.recompute}};
  if (a.recompute && a.recompute_ranks > 0) config["recompute_ranks"] = a.recompute_ranks;
  if (a.recompute && !a.recompute_on.empty()) config["recompute_on"] = a.recompute_on;
  if (m.model == "resnet") {
    config["channels"] = m.channels;
    config["image_size"] = m.image_size;
    config["in_channels"] = m.in_channels;
    config["classes"] = m.classes;
  }
  if (a.dp > 1) config["dp"] = a.dp;
  if (a.variable_seq) config["variable_seq"] = true;
  if (a.memory_limit_mb > 0) config["memory_limit_mb"] = a.memory_limit_mb;
  config["memory_source"] = memory::source(c10::Device(c10::DeviceType::CPU));
  config["energy_source"] = energy_source.empty() ? Json(nullptr) : Json(energy_source);
  if (!energy) {
    config["energy_note"] =
        energy_note.empty() ? "a rank other than 0 has no energy meter for its hardware" : energy_note;
  }
  return config;
}

// Where rank 0 reports from: the transport's name, its energy meter ("nvml", "rapl", "") and why it has none.
struct ReportSource {
  std::string transport, energy, energy_note;
};

// --json and --csv of the configurations in `results`. `configs`: (finished, of), recorded in the document's
// config. Before the `final` write they are written as the run goes, after each configuration, so that a rank
// killed by its launcher after a signal loses at most the configuration in progress -- only into files that can
// be rewritten (twobp::rewritable: a device node or FIFO gets the final write alone). Returns the files written.
std::vector<std::string> write_results(const PipelineArgs& a, const std::vector<RunResult>& results,
                                       const ReportSource& source, std::pair<int, int> configs, bool final) {
  const bool tokens = tokens_per_sample(a.model) > 0;  // resnet: samples/s
  const bool energy =
      std::any_of(results.begin(), results.end(), [](const RunResult& r) { return r.energy_j.has_value(); });
  const Reporter<ResultRow> reporter(result_columns(a, tokens), result_table(a, tokens, energy));
  const std::vector<ResultRow> rows = result_rows(a, results, tokens);
  // The run document (twobp/plan/record.h): its writer places the record's fields at the columns' places.
  RunDocument doc;
  const PipelineModelArgs& m = a.model;
  doc.model = {m.model, m.dim, m.layers, m.heads, m.kv_heads, m.ffn, m.vocab, m.seq, m.micro_batch_size};
  Json config = report_config(a, source.transport, energy, source.energy, source.energy_note);
  config["configurations"] = {{"finished", configs.first}, {"of", configs.second}};
  doc.config_extra = config.dump();
  for (const ResultRow& row : rows) {
    const RunResult& r = *row.r;
    RunRecord record{r.schedule, r.mode, r.p, r.m, r.v, "", r.dp, r.memory_limit, "", r.costs,
                     reporter.json(row).dump()};
    if (a.variable_seq) record.shapes = r.announced ? "announced" : "fixed";
    doc.results.push_back(std::move(record));
  }
  std::vector<std::string> written;
  if (!a.json.empty() && (final || rewritable(a.json))) {
    write_file(a.json, write_run_document(doc) + "\n", "--json");
    written.push_back(a.json);
  }
  if (!a.csv.empty() && (final || rewritable(a.csv))) {
    write_file(a.csv, reporter.csv(rows), "--csv");
    written.push_back(a.csv);
  }
  return written;
}

void report(const PipelineArgs& a, const std::vector<RunResult>& results, const ReportSource& source,
            std::pair<int, int> configs) {
  const bool tokens = tokens_per_sample(a.model) > 0;  // resnet: samples/s
  const bool energy =
      std::any_of(results.begin(), results.end(), [](const RunResult& r) { return r.energy_j.has_value(); });
  const Reporter<ResultRow> reporter(result_columns(a, tokens), result_table(a, tokens, energy));
  print_table(std::cout, reporter.table(result_rows(a, results, tokens)));
  for (const std::string& file : write_results(a, results, source, configs, /*final=*/true)) {
    std::cout << "wrote " << file << "\n";
  }
  if (!a.chart.empty()) {
    write_chart(a, results, tokens);
    std::cout << "wrote " << a.chart << " (throughput chart)\n";
  }
  if (!a.trace_dir.empty()) {
    std::size_t n = 0;
    for (const auto& r : results) n += r.trace_files.size();
    std::cout << fmt::format("wrote {} trace files to {}/: <schedule>_<mode>_p<p>_m<m>.trace.json (Chrome / Perfetto) "
                             "and .svg (timeline) of the last measured step per configuration\n",
                             n, a.trace_dir);
  }
}

// With data parallelism every configuration runs with the reductions overlapped (standard mode: with its buckets
// started during its last B, then after it), then without.
std::vector<DpBuckets> dp_bucket_settings(const PipelineArgs& a, BackwardMode mode) {
  if (a.dp <= 1) return {DpBuckets{}};
  std::vector<DpBuckets> out{DpBuckets{true, true}};
  if (mode == BackwardMode::kStandard) out.push_back(DpBuckets{true, false});
  out.push_back(DpBuckets{false, true});
  return out;
}

// With --variable-seq every configuration runs with fixed specs and with shapes announced, in turn; with
// --memory-limit-mb without and with the limit.
std::vector<Variant> variants_of(const PipelineArgs& a) {
  std::vector<Variant> variants{Variant{}};
  if (a.variable_seq) variants.push_back(Variant{true, 0});
  if (a.memory_limit_mb > 0) variants.push_back(Variant{false, static_cast<int64_t>(a.memory_limit_mb * kMiB)});
  return variants;
}

// The progress line as configuration k of `total` starts (rank 0, on stderr).
void announce_configuration(const PipelineArgs& a, int k, int total, double elapsed_s, const std::string& name,
                            BackwardMode mode, int pp, const DpBuckets& buckets) {
  std::cerr << fmt::format("[pipeline] {}: {} {} p={} m={}{}{} ...\n",
                           metrics::format_progress("configuration", k, total, elapsed_s), name, to_string(mode), pp,
                           a.microbatches, a.dp > 1 ? fmt::format(" dp={} buckets={}", a.dp, buckets.name()) : "",
                           a.variable_seq            ? ", fixed specs and announced shapes in turn"
                           : a.memory_limit_mb > 0 ? ", without and with the memory limit in turn"
                                                     : "");
}

void run_pipeline_bench(const PipelineArgs& a) {
  // Before any model exists: tensor memory is counted per rank from here on (twobp/metrics/memory.h).
  memory::count_cpu_allocations();
  cli::refuse_shared_paths({{"--json", a.json}, {"--csv", a.csv}, {"--chart", a.chart}, {"--trace-dir", a.trace_dir}},
                           {{"--schedule-file", a.schedule_file}});
  at::set_num_threads(a.threads);
  std::vector<std::string> names = name_list(a.schedule, schedule_names(), "schedule");
  std::vector<BackwardMode> modes = mode_list(a.mode);
  if (!a.schedule_file.empty()) {
    // The file fixes the schedule and its mode; ranks and micro-batches are checked against it when it is used.
    const Schedule s = load_schedule_file(a.schedule_file);
    names = {s.name};
    modes = {s.backward};
  }

  const std::vector<Variant> variants = variants_of(a);
  ReportSource source;  // rank 0's transport and energy meter
  // Ctrl-C / SIGTERM: the configuration in progress ends, the finished ones are reported and written, and the
  // command exits 130 / 143 (twobp/runtime/interrupt.h). Under a launcher that kills the ranks soon after its
  // signal, the files written after each configuration keep the finished ones. Rank 0 (or the process that runs
  // the threads) acknowledges the signal.
  const std::optional<LaunchEnv> launched = launch_env();
  InterruptGuard interrupts(/*announce=*/!launched || launched->rank == 0);
  int configs_total = 0, configs_done = 0;  // configs_done: rank 0's
  for (BackwardMode mode : modes) configs_total += static_cast<int>(names.size() * dp_bucket_settings(a, mode).size());
  const auto started = std::chrono::steady_clock::now();
  auto run_all = [&](Transport& t) {
    const Duration timeout{static_cast<int64_t>(a.timeout_s * 1000)};
    ParallelGroups groups(t, a.dp, timeout);  // UsageError unless dp divides the world size
    energy::EnergyOptions eo;
    eo.powercap_root = a.powercap_root;
    energy::RankEnergy rank_energy = energy::rank_energy(t, t.device(), eo);
    if (t.rank() == 0) {
      source = {t.name(), rank_energy.source(), rank_energy.note()};
      cli::warn_if_loaded("pipeline", "--threads 1");
    }
    std::vector<RunResult> results;
    int k = 0;
    for (const auto& name : names) {
      for (BackwardMode mode : modes) {
        for (const DpBuckets& buckets : dp_bucket_settings(a, mode)) {
          if (interrupts.agreed(t, timeout)) return results;  // every rank stops before the same configuration
          ++k;
          if (t.rank() == 0) {
            const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - started;
            announce_configuration(a, k, configs_total, elapsed.count(), name, mode, groups.layout().pp, buckets);
          }
          for (RunResult& r : run_config(t, groups, a, name, mode, buckets, variants, rank_energy)) {
            results.push_back(std::move(r));
          }
          if (t.rank() == 0) {
            configs_done = k;
            write_results(a, results, source, {k, configs_total}, /*final=*/false);
            interrupts.set_announcement(fmt::format("finishing configuration {} of {}{}", k + 1, configs_total,
                                                    a.json.empty() && a.csv.empty() ? "" : ", then writing the results"));
          }
        }
      }
    }
    return results;
  };

  // Under mpirun one rank per process over MPI (under torchrun/srun, or mpirun without MPI: a TCPStore); else
  // --ranks threads over Local transports. Rank 0 reports.
  RunRanksOptions o;
  o.thread_ranks = a.dp * a.ranks;  // threads: dp replicas of --ranks pipeline ranks
#if TWOBP_HAVE_MPI
  std::unique_ptr<MpiEnvironment> env;
  if (launched_by_mpi_launcher()) {
    env = std::make_unique<MpiEnvironment>();
    o.process_transport = mpi_process_transport(*env);
    o.launch = mpi_launch_env(*env);
  }
#endif
  if (!o.launch && !launch_env()) cli::check_rank_threads(a.dp, a.ranks);  // before any thread starts
  std::vector<RunResult> results;
  std::string transport_name;
  run_ranks(o, [&](Transport& t) {
    std::vector<RunResult> mine = run_all(t);
    if (t.rank() == 0) {
      results = std::move(mine);
      transport_name = t.name();
    }
  });
  // This process ran rank 0.
  if (!transport_name.empty()) {
    if (interrupts.received() != 0) {
      std::cerr << fmt::format("[pipeline] interrupted by {}: {} of {} configurations finished; reporting those\n",
                               interrupts.received_name(), configs_done, configs_total);
    }
    report(a, results, source, {configs_done, configs_total});
  }
  if (interrupts.received() != 0) throw CLI::RuntimeError(interrupts.exit_status());
}

}  // namespace

void add_pipeline_command(CLI::App& app) {
  auto a = std::make_shared<PipelineArgs>();
  CLI::App* sub = app.add_subcommand("pipeline", "Throughput of pipelines, 2BP against standard backprop");
  sub->add_option("--schedule", a->schedule, "Registered schedule, several separated by commas, or all")
      ->check(names_in(schedule_names(), "schedule"))
      ->capture_default_str();
  sub->add_option("--schedule-file", a->schedule_file,
                  "Run this schedule (text form, see dump_schedule) instead; it keeps its own 2BP mode")
      ->check(cli::regular_file());
  sub->add_option("--mode", a->mode, "standard, 2bp or both")->check(CLI::IsMember(mode_choices()))
      ->capture_default_str();
  sub->add_option("--ranks", a->ranks,
                  "Pipeline ranks p; ranks run as dp x p threads (ignored under mpirun: one rank per process, "
                  "p = world size / dp)")
      ->capture_default_str()->check(cli::number_in(1, cli::kMaxRanks));
  sub->add_option("--dp", a->dp,
                  "Data-parallel replicas of the pipeline (world = dp x p; each configuration then runs with the "
                  "gradient reductions overlapped -- standard mode: started during and after its last B -- and not)")
      ->capture_default_str()->check(cli::number_in(1, cli::kMaxRanks));
  sub->add_option("--chunks-per-rank", a->chunks_per_rank,
                  "v (default: the schedule's: 2 for the looped and V schedules, else 1)")
      ->check(cli::number_in(0, 64, " (0: the schedule's default)"));
  sub->add_option("--model", a->model.model, "llama (fast path), bert or resnet (general autograd-graph split)")
      ->check(CLI::IsMember(pipeline_model_names()))->capture_default_str();
  PipelineModelArgs& m = a->model;
  count_option(sub, "--microbatches,--micro-batches", a->microbatches, "Micro-batches per step");
  count_option(sub, "--dim", m.dim, "Model width (llama, bert)");
  count_option(sub, "--layers", m.layers, "Blocks over all stages (decoder, encoder or residual blocks)");
  count_option(sub, "--heads", m.heads, "Attention heads (llama, bert)");
  count_option(sub, "--kv-heads", m.kv_heads, "Key/value heads (llama)");
  count_option(sub, "--ffn", m.ffn, "MLP hidden width (llama: SwiGLU, bert: GELU)");
  count_option(sub, "--vocab", m.vocab, "Vocabulary (llama, bert)");
  count_option(sub, "--seq", m.seq, "Tokens per sequence (llama, bert)");
  count_option(sub, "--channels", m.channels, "Conv channels of every residual block (resnet)");
  count_option(sub, "--image-size", m.image_size, "Input height = width (resnet)");
  count_option(sub, "--in-channels", m.in_channels, "Input image channels (resnet)");
  count_option(sub, "--classes", m.classes, "Classes of the head (resnet)");
  count_option(sub, "--micro-batch-size", m.micro_batch_size, "Samples (sequences or images) per micro-batch");
  count_option(sub, "--steps", a->steps, "Measured steps");
  count_option(sub, "--warmup", a->warmup, "Unmeasured steps first", 0, cli::kMaxCount);
  count_option(sub, "--threads", a->threads, "at::set_num_threads (per process)", 1, cli::kMaxRanks);
  count_option(sub, "--timeout", a->timeout_s, "Seconds any wait may block", 1e-3, 1e7);
  sub->add_option("--powercap-root", a->powercap_root,
                  "Where RAPL's powercap zones are (energy on CPUs; another root for tests or containers)")
      ->capture_default_str();
  auto* recompute = sub->add_flag("--recompute", a->recompute,
                                  "Activation recomputation on every stage: F keeps only its inputs, each I/B "
                                  "re-runs the forward");
  auto* first_ranks = sub->add_option("--recompute-ranks", a->recompute_ranks,
                                      "With --recompute: only the stages of pipeline ranks 0 .. N-1 recompute")
                          ->needs(recompute)
                          ->check(cli::number_in(1, cli::kMaxRanks));
  sub->add_option("--recompute-on", a->recompute_on,
                  "With --recompute: only the stages of these pipeline ranks recompute (ranks and ranges, e.g. 3 or "
                  "0-1,3; what `plan` ranks)")
      ->needs(recompute)
      ->excludes(first_ranks);
  sub->add_flag("--variable-seq", a->variable_seq,
               "Also run every configuration with shapes announced by the senders (no activation spec: what "
               "sequence lengths that vary per step or micro-batch need), same data; reports announce_ratio");
  sub->add_option("--memory-limit-mb", a->memory_limit_mb,
                  "Also run every configuration with ExecutorOptions::memory_limit_bytes = this many MiB of tensor "
                  "memory per rank (memory-bounded 2BP); reports limit_held and limit_ratio")
      ->check(cli::number_in(1e-6, 1e9))
      ->excludes("--variable-seq");
  sub->add_option("--json", a->json, "Write {\"config\", \"results\": [...]} here")->check(cli::writable_file());
  sub->add_option("--csv", a->csv, "Write one CSV row per configuration here")->check(cli::writable_file());
  sub->add_option("--trace-dir", a->trace_dir, "Write a Chrome trace and an SVG of the last step per configuration")
      ->check(cli::writable_directory());
  sub->add_option("--chart", a->chart, "Write an SVG bar chart of the throughput, standard vs 2BP per schedule")
      ->check(cli::writable_file());
  sub->callback([a] { run_pipeline_bench(*a); });
}

}  // namespace twobp::bench
