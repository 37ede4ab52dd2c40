#include "twobp/plan/measure.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/stage.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"
#include "util/cost_check.h"
#include "util/positive.h"

namespace twobp {

using detail::any_positive;

namespace {


double median_or_zero(const std::vector<double>& samples) {
  return samples.empty() ? 0.0 : metrics::quantile(samples, 0.5);
}

std::vector<double> medians(const std::vector<std::vector<double>>& per_stage) {
  std::vector<double> out;
  out.reserve(per_stage.size());
  for (const auto& samples : per_stage) out.push_back(median_or_zero(samples));
  return out;
}

// Each replica's pipeline agreed on its own numbers `v`; the mean over the data-parallel group `replicas` (none:
// `v` itself) is the job's, so that every rank of it holds the same numbers.
std::vector<double> mean_over_replicas(Transport* replicas, std::vector<double> v, Duration timeout) {
  if (replicas == nullptr || replicas->world_size() <= 1) return v;
  v = sum_over_ranks(*replicas, v, timeout);
  for (double& x : v) x /= static_cast<double>(replicas->world_size());
  return v;
}

// Every per-stage list has one entry per stage (recompute may be empty); `who` names the caller.
void check_sizes(const MeasuredCosts& c, const std::string& who) {
  const std::size_t S = c.forward.size();
  TWOBP_CHECK(c.backward_input.size() == S && c.backward_weight.size() == S && c.backward.size() == S &&
                  (c.recompute.empty() || c.recompute.size() == S) &&
                  (c.backward_weight_fixed.empty() || c.backward_weight_fixed.size() == S),
              UsageError,
              "{}: per-stage sizes differ (F {}, I {}, W {}, B {}, R {}, W0 {}); every list needs one entry per stage",
              who, S, c.backward_input.size(), c.backward_weight.size(), c.backward.size(), c.recompute.size(),
              c.backward_weight_fixed.size());
}

void check_stage(int stage, int num_stages, const TraceEvent& e, const char* who) {
  TWOBP_CHECK(stage >= 0 && stage < num_stages, UsageError,
              "{}: rank {} traced a {} of stage {}, but the recorder was made for {} stages (pass the schedule's "
              "num_stages)",
              who, e.rank, to_string(e.action.type), stage, num_stages);
}

}  // namespace

void check_measured_costs(const MeasuredCosts& c, const std::string& where) {
  check_sizes(c, where);
  detail::check_cost_lists({{"costs_ms.F", &c.forward},
                            {"costs_ms.I", &c.backward_input},
                            {"costs_ms.W", &c.backward_weight},
                            {"costs_ms.W0", &c.backward_weight_fixed},
                            {"costs_ms.B", &c.backward},
                            {"costs_ms.R", &c.recompute}},
                           where, detail::kMaxCostMs);
  detail::check_cost(c.communication, where, "communication_ms", detail::kMaxCostMs, "time in ms");
  TWOBP_CHECK(c.overlap >= 0.0 && c.overlap <= 1.0, UsageError, "{}: overlap.share is {}, expected a share in [0, 1]",
              where, c.overlap);
}

WeightCost fit_weight_cost(const std::map<int, std::vector<double>>& ms_by_micro_batches) {
  std::vector<double> per_micro_batch;
  for (const auto& [k, samples] : ms_by_micro_batches) {
    TWOBP_CHECK(k >= 1, UsageError, "fit_weight_cost: a W of {} micro-batches (expected >= 1)", k);
    for (double ms : samples) {
      TWOBP_CHECK(std::isfinite(ms) && ms >= 0.0, UsageError,
                  "fit_weight_cost: a W of {} micro-batches took {} ms (expected a finite time >= 0)", k, ms);
      per_micro_batch.push_back(ms / k);
    }
  }
  const WeightCost proportional{0.0, median_or_zero(per_micro_batch)};
  // Least squares of ms = a + b k over the (k, median) points, one per count.
  double n = 0.0, sk = 0.0, sm = 0.0, skk = 0.0, skm = 0.0;
  for (const auto& [k, samples] : ms_by_micro_batches) {
    if (samples.empty()) continue;
    const double m = median_or_zero(samples);
    n += 1.0;
    sk += k;
    sm += m;
    skk += static_cast<double>(k) * k;
    skm += k * m;
  }
  if (n < 2.0) return proportional;  // one count (or none) cannot tell a fixed part from the rest
  const double b = (n * skm - sk * sm) / (n * skk - sk * sk);  // the counts differ, so the denominator is > 0
  const double a = (sm - b * sk) / n;
  // A fixed part at rounding level (durations exactly proportional) is none.
  return a > 1e-9 * sm / n && b > 0.0 ? WeightCost{a, b} : proportional;
}

CostModel MeasuredCosts::cost_model(BackwardMode mode) const {
  const std::size_t S = forward.size();
  TWOBP_CHECK(S > 0, UsageError, "MeasuredCosts::cost_model: no stages (measure a run first)");
  check_measured_costs(*this, "MeasuredCosts::cost_model");
  CostModel costs;
  costs.forward = forward;
  costs.communication = communication;
  costs.overlap = overlap;
  if (any_positive(recompute)) costs.recompute = recompute;
  if (mode == BackwardMode::kSplit) {
    TWOBP_CHECK(any_positive(backward_input), UsageError,
                "MeasuredCosts::cost_model: 2BP needs I and W costs, and these are all 0 (costs of a standard run?); "
                "measure a 2BP run, or simulate BackwardMode::kStandard");
    costs.backward_input = backward_input;
    costs.backward_weight = backward_weight;
    costs.backward_weight_fixed = backward_weight_fixed;
    // A 2BP schedule may fuse some backwards (DualPipeV's last ones): when the run had any, the simulator takes
    // their measured cost, and I + W on the stages that had none.
    if (any_positive(backward)) {
      costs.backward = backward;
      for (std::size_t s = 0; s < S; ++s) {
        if (costs.backward[s] <= 0.0) costs.backward[s] = costs.unfused_backward(static_cast<int>(s));
      }
    }
  } else {
    TWOBP_CHECK(any_positive(backward), UsageError,
                "MeasuredCosts::cost_model: standard backprop needs B costs, and these are all 0 (costs of a 2BP "
                "run?); measure a standard run, or simulate BackwardMode::kSplit");
    costs.backward = backward;
    costs.backward_input.assign(S, 0.0);
    costs.backward_weight.assign(S, 0.0);
  }
  return costs;
}

CostRecorder::CostRecorder(int num_stages)
    : num_stages_(num_stages), f_(num_stages), i_(num_stages), b_(num_stages), r_(num_stages), w_(num_stages) {
  TWOBP_CHECK(num_stages > 0, UsageError, "CostRecorder: num_stages must be positive, got {}", num_stages);
}

void CostRecorder::add(const Trace& trace) {
  const std::vector<TraceEvent>& events = trace.events;
  for (std::size_t k = 0; k < events.size(); ++k) {
    const TraceEvent& e = events[k];
    if (!is_compute(e.action.type)) continue;
    const int s = e.action.stage;
    check_stage(s, num_stages_, e, "CostRecorder::add");
    if (ran_as_pair(events, k)) {  // the pair's span only; resolve_pairs() makes costs of it
      const TraceEvent& second = events[++k];
      check_stage(second.action.stage, num_stages_, second, "CostRecorder::add");
      pairs_.push_back({s, second.action.type, second.action.stage, (e.end_us - e.start_us) / 1000.0});
      if (second.action.type != ActionType::kForward) r_[second.action.stage].push_back(second.recompute_us / 1000.0);
      continue;
    }
    const double ms = (e.end_us - e.start_us - e.recompute_us) / 1000.0;
    switch (e.action.type) {
      case ActionType::kForward: f_[s].push_back(ms); break;
      case ActionType::kBackwardInput:
        i_[s].push_back(ms);
        r_[s].push_back(e.recompute_us / 1000.0);
        break;
      case ActionType::kBackward:
        b_[s].push_back(ms);
        r_[s].push_back(e.recompute_us / 1000.0);
        break;
      case ActionType::kBackwardWeight:
        w_[s][std::max(1, static_cast<int>(e.action.micro_batches.size()))].push_back(ms);
        break;
      default: break;
    }
  }
  ++steps_;
}

MeasuredCosts CostRecorder::local_medians() const {
  MeasuredCosts c;
  c.forward = medians(f_);
  c.backward_input = medians(i_);
  c.backward = medians(b_);
  c.recompute = medians(r_);
  if (!any_positive(c.recompute)) c.recompute.clear();
  for (const auto& by_size : w_) {
    const WeightCost w = fit_weight_cost(by_size);
    c.backward_weight_fixed.push_back(w.fixed);
    c.backward_weight.push_back(w.per_micro_batch);
  }
  if (!any_positive(c.backward_weight_fixed)) c.backward_weight_fixed.clear();
  if (!pairs_.empty()) resolve_pairs(c);
  return c;
}

void CostRecorder::resolve_pairs(MeasuredCosts& c) const {
  // A part's cost as the simulator charges it (action_cost): F, or I / B with its recomputation. Known
  // when the stage ran that type outside pairs; nullopt otherwise.
  auto recompute = [&](int s) { return c.recompute.empty() ? 0.0 : c.recompute[s]; };
  auto known = [&](ActionType type, int s) -> std::optional<double> {
    switch (type) {
      case ActionType::kForward:
        if (!f_[s].empty()) return c.forward[s];
        break;
      case ActionType::kBackwardInput:
        if (!i_[s].empty()) return c.backward_input[s] + recompute(s);
        break;
      case ActionType::kBackward:
        if (!b_[s].empty()) return c.backward[s] + recompute(s);
        break;
      default: break;
    }
    return std::nullopt;
  };
  // The overlap, from the pairs whose both parts are known: the model t = f + x - overlap * min(f, x), inverted.
  std::vector<double> shares;
  for (const PairSample& p : pairs_) {
    const auto f = known(ActionType::kForward, p.forward_stage), x = known(p.second_type, p.second_stage);
    if (f && x && std::min(*f, *x) > 0.0) shares.push_back(std::clamp((*f + *x - p.ms) / std::min(*f, *x), 0.0, 1.0));
  }
  const double o = median_or_zero(shares);
  c.overlap = o;
  c.overlapped_pairs = static_cast<int>(pairs_.size());
  // A part known from no action outside pairs: the cost u with which the model gives each of its pairs' span, the
  // other part costing k (known) -- t = max(u, k) + (1 - o) min(u, k) -- or, both unknown, u = t / (2 - o).
  auto solve = [o](double t, std::optional<double> k) {
    if (!k) return t / (2.0 - o);
    const double longer = t - (1.0 - o) * *k;  // u >= k
    if (longer >= *k || o >= 1.0) return std::max(longer, 0.0);
    return std::max((t - *k) / (1.0 - o), 0.0);  // u < k
  };
  std::map<std::pair<ActionType, int>, std::vector<double>> solved;
  for (const PairSample& p : pairs_) {
    const auto f = known(ActionType::kForward, p.forward_stage), x = known(p.second_type, p.second_stage);
    if (!f) solved[{ActionType::kForward, p.forward_stage}].push_back(solve(p.ms, x));
    if (!x) solved[{p.second_type, p.second_stage}].push_back(solve(p.ms, f));
  }
  for (const auto& [part, samples] : solved) {
    const auto [type, s] = part;
    const double u = median_or_zero(samples);
    if (type == ActionType::kForward) c.forward[s] = u;
    if (type == ActionType::kBackwardInput) c.backward_input[s] = std::max(u - recompute(s), 0.0);
    if (type == ActionType::kBackward) c.backward[s] = std::max(u - recompute(s), 0.0);
  }
}

double measure_message_ms(Transport& transport, const at::Tensor& message, Duration timeout, int round_trips) {
  TWOBP_CHECK(round_trips >= 1, UsageError, "measure_message_ms: round_trips must be >= 1 (got {})", round_trips);
  if (transport.world_size() < 2) return 0.0;
  std::vector<double> trips;
  // Zeros, not random values: the content does not change the time, and drawing them would advance the global
  // generator that rank threads share.
  at::Tensor buffer = at::zeros_like(message);
  const int rank = transport.rank(), peer = 1 - rank;
  for (int i = 0; i < round_trips && rank < 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t ping = 1'000'000 + 2 * static_cast<int64_t>(i), pong = ping + 1;
    if (rank == 0) {
      transport.isend(buffer, {peer, ping, "ping"})->wait(timeout);
      transport.irecv(buffer, {peer, pong, "pong"})->wait(timeout);
    } else {
      transport.irecv(buffer, {peer, ping, "ping"})->wait(timeout);
      transport.isend(buffer, {peer, pong, "pong"})->wait(timeout);
    }
    trips.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const std::vector<double> mine{rank == 0 ? median_or_zero(trips) / 2.0 : 0.0};
  transport.barrier(timeout);
  return sum_over_ranks(transport, mine, timeout)[0];
}

MeasuredCosts agree_costs(Transport& transport, const MeasuredCosts& mine, Duration timeout, Transport* replicas) {
  const std::size_t S = mine.forward.size();
  check_sizes(mine, fmt::format("agree_costs: rank {}", transport.rank()));
  // Slots: K per stage (F, I, W, B, R, W0), then "has recomputation", overlap x pairs and pairs, then
  // communication as a max through a sum of one-hot slots (one per rank).
  constexpr std::size_t K = 6;
  const std::size_t p = static_cast<std::size_t>(transport.world_size());
  std::vector<double> v(K * S + 3 + p, 0.0);
  for (std::size_t s = 0; s < S; ++s) {
    v[K * s] = mine.forward[s];
    v[K * s + 1] = mine.backward_input[s];
    v[K * s + 2] = mine.backward_weight[s];
    v[K * s + 3] = mine.backward[s];
    v[K * s + 4] = mine.recompute.empty() ? 0.0 : mine.recompute[s];
    v[K * s + 5] = mine.backward_weight_fixed.empty() ? 0.0 : mine.backward_weight_fixed[s];
  }
  v[K * S] = mine.recompute.empty() ? 0.0 : 1.0;
  v[K * S + 1] = mine.overlap * mine.overlapped_pairs;
  v[K * S + 2] = mine.overlapped_pairs;
  v[K * S + 3 + static_cast<std::size_t>(transport.rank())] = mine.communication;
  // Every rank must bring the same number of stages, else the sum mixes fields: agree on S first.
  std::vector<double> sizes(p, 0.0);
  sizes[static_cast<std::size_t>(transport.rank())] = static_cast<double>(S);
  sizes = sum_over_ranks(transport, sizes, timeout);
  for (std::size_t r = 0; r < p; ++r) {
    TWOBP_CHECK(sizes[r] == static_cast<double>(S), UsageError,
                "agree_costs: rank {} has costs of {} stages, rank {} of {}; every rank must record the whole "
                "schedule's stages (CostRecorder(schedule.num_stages))",
                transport.rank(), S, r, sizes[r]);
  }
  // The flag and the communication max stay positive exactly when some replica's were.
  v = mean_over_replicas(replicas, sum_over_ranks(transport, v, timeout), timeout);
  MeasuredCosts out;
  for (std::size_t s = 0; s < S; ++s) {
    out.forward.push_back(v[K * s]);
    out.backward_input.push_back(v[K * s + 1]);
    out.backward_weight.push_back(v[K * s + 2]);
    out.backward.push_back(v[K * s + 3]);
    out.recompute.push_back(v[K * s + 4]);
    out.backward_weight_fixed.push_back(v[K * s + 5]);
  }
  if (v[K * S] == 0.0) out.recompute.clear();
  if (!any_positive(out.backward_weight_fixed)) out.backward_weight_fixed.clear();
  if (v[K * S + 2] > 0.0) {  // the replicas' mean of both keeps the weighted mean
    out.overlap = v[K * S + 1] / v[K * S + 2];
    out.overlapped_pairs = static_cast<int>(std::lround(v[K * S + 2]));
  }
  out.communication = *std::max_element(v.begin() + static_cast<std::ptrdiff_t>(K * S + 3), v.end());
  return out;
}

MemoryRecorder::MemoryRecorder(int num_stages, std::vector<double> gradient_bytes)
    : num_stages_(num_stages),
      gradient_bytes_(std::move(gradient_bytes)),
      added_(num_stages),
      rise_(num_stages),
      count_(num_stages) {
  TWOBP_CHECK(num_stages > 0, UsageError, "MemoryRecorder: num_stages must be positive, got {}", num_stages);
  TWOBP_CHECK(static_cast<int>(gradient_bytes_.size()) == num_stages, UsageError,
              "MemoryRecorder: gradient_bytes has {} entries for {} stages (one per stage; 0 for other ranks' stages)",
              gradient_bytes_.size(), num_stages);
}

void MemoryRecorder::add(const Trace& trace) {
  if (trace.events.empty()) return;
  const TraceEvent& first = trace.events.front();
  TWOBP_CHECK(first.memory_before >= 0, UsageError,
              "MemoryRecorder::add: rank {}'s trace has no memory readings; run the pipeline with "
              "PipelineOptions::executor.record_memory = true",
              first.rank);
  base_.push_back(static_cast<double>(first.memory_before));
  std::set<int> has_gradients;
  const TraceEvent* previous = nullptr;
  for (const TraceEvent& e : trace.events) {
    if (previous != nullptr) between_ += static_cast<double>(e.memory_before - previous->memory_after);
    previous = &e;
    const int s = e.action.stage;
    check_stage(s, num_stages_, e, "MemoryRecorder::add");
    const int type = static_cast<int>(e.action.type);
    const bool weights = makes_weight_grads(e.action.type);
    const double g = weights && has_gradients.insert(s).second ? gradient_bytes_[s] : 0.0;
    const double k = e.action.type == ActionType::kBackwardWeight
                         ? static_cast<double>(std::max<std::size_t>(1, e.action.micro_batches.size()))
                         : 1.0;
    const double added = static_cast<double>(e.memory_after - e.memory_before) - g;
    left_ += added;
    added_[s][type].push_back(added / k);
    rise_[s][type].push_back((static_cast<double>(e.memory_peak - e.memory_before) - g) / k);
    count_[s][type] += k;
  }
}

MemoryModel MemoryRecorder::local_medians(int rank, int num_ranks) const {
  TWOBP_CHECK(rank >= 0 && rank < num_ranks, UsageError, "MemoryRecorder::local_medians: rank {} of {} ranks", rank,
              num_ranks);
  MemoryModel m;
  m.base.assign(static_cast<std::size_t>(num_ranks), 0.0);
  m.base[static_cast<std::size_t>(rank)] = median_or_zero(base_);
  m.stages.resize(static_cast<std::size_t>(num_stages_));
  constexpr int kI = static_cast<int>(ActionType::kBackwardInput), kB = static_cast<int>(ActionType::kBackward);
  // The share of what the actions left behind that frees between them took back: 1 when every message was freed
  // between actions, 0 when nothing was (what a step keeps until after its last action, such as data-parallel
  // buckets, is left to the model as measured). The last message of a step is freed after it: slightly under 1.
  const double closed = left_ > 0.0 && between_ < 0.0 ? std::min(1.0, -between_ / left_) : 0.0;
  for (int s = 0; s < num_stages_; ++s) {
    double residual = 0.0;  // what one step's actions of this stage leave behind, walked with the medians
    for (int t = 0; t < kNumActionTypes; ++t) {
      m.stages[s][t] = {median_or_zero(added_[s][t]), median_or_zero(rise_[s][t])};
      residual += count_[s][t] * m.stages[s][t].added;
    }
    const double backwards = count_[s][kI] + count_[s][kB];
    if (backwards == 0.0) continue;  // a stage that never ran backward here (or nothing recorded): nothing to close
    for (int t : {kI, kB}) {
      if (count_[s][t] > 0.0) m.stages[s][t].added -= closed * residual / backwards;
    }
  }
  m.gradients = gradient_bytes_;
  return m;
}

PeakMemory compare_peak_memory(Transport& transport, const Schedule& schedule, const MemoryRecorder& recorder,
                               double my_peak, Duration timeout) {
  const int p = transport.world_size();
  PeakMemory out;
  out.model = agree_memory(transport, recorder.local_medians(transport.rank(), p), timeout);
  out.measured = gather_over_ranks(transport, my_peak, timeout);
  out.predicted = simulate_peak_memory(schedule, out.model);
  for (int rank = 0; rank < p; ++rank) {
    double fixed = out.model.base[rank];
    for (int s : schedule.stages_of(rank)) fixed += out.model.gradients[s];
    out.measured_step.push_back(out.measured[rank] - fixed);
    out.predicted_step.push_back(out.predicted[rank] - fixed);
  }
  return out;
}

MemoryModel agree_memory(Transport& transport, const MemoryModel& mine, Duration timeout, Transport* replicas) {
  const std::size_t p = mine.base.size(), S = mine.stages.size();
  TWOBP_CHECK(p == static_cast<std::size_t>(transport.world_size()) && mine.gradients.size() == S, UsageError,
              "agree_memory: rank {}: the model has base for {} ranks (the transport has {}) and gradients for {} of "
              "its {} stages; pass MemoryRecorder::local_medians(rank, world size)",
              transport.rank(), p, transport.world_size(), mine.gradients.size(), S);
  constexpr std::size_t kPerStage = 2 * kNumActionTypes + 1;  // (added, rise) per action type, then gradient bytes
  std::vector<double> v(p + kPerStage * S, 0.0);
  std::copy(mine.base.begin(), mine.base.end(), v.begin());
  for (std::size_t s = 0; s < S; ++s) {
    double* row = &v[p + kPerStage * s];
    for (int t = 0; t < kNumActionTypes; ++t) {
      row[2 * t] = mine.stages[s][t].added;
      row[2 * t + 1] = mine.stages[s][t].rise;
    }
    row[2 * kNumActionTypes] = mine.gradients[s];
  }
  v = mean_over_replicas(replicas, sum_over_ranks(transport, v, timeout), timeout);
  MemoryModel out;
  out.base.assign(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(p));
  out.stages.resize(S);
  out.gradients.resize(S);
  for (std::size_t s = 0; s < S; ++s) {
    const double* row = &v[p + kPerStage * s];
    for (int t = 0; t < kNumActionTypes; ++t) out.stages[s][t] = {row[2 * t], row[2 * t + 1]};
    out.gradients[s] = row[2 * kNumActionTypes];
  }
  return out;
}

std::vector<double> stage_gradient_bytes(Pipeline& pipeline) {
  // Mixed precision: the masters' float32 .grad is what a W or B allocates (the compute parameters' stays undefined).
  const bool masters = pipeline.options().mixed_precision.enabled();
  std::vector<double> bytes(static_cast<std::size_t>(pipeline.schedule().num_stages), 0.0);
  std::set<const void*> counted;
  for (int s : pipeline.stage_indices()) {
    for (const at::Tensor& t : pipeline.stage(s).parameters()) {
      if (!t.requires_grad() || !counted.insert(t.unsafeGetTensorImpl()).second) continue;
      bytes[static_cast<std::size_t>(s)] +=
          static_cast<double>(t.numel()) * static_cast<double>(masters ? sizeof(float) : t.element_size());
    }
  }
  return bytes;
}

std::string measured_costs_json(const MeasuredCosts& costs) {
  nlohmann::ordered_json out;
  out["communication_ms"] = costs.communication;
  out["costs_ms"] = {{"F", costs.forward}, {"I", costs.backward_input}, {"W", costs.backward_weight},
                     {"B", costs.backward}};
  if (!costs.recompute.empty()) out["costs_ms"]["R"] = costs.recompute;
  if (!costs.backward_weight_fixed.empty()) out["costs_ms"]["W0"] = costs.backward_weight_fixed;
  if (costs.overlapped_pairs > 0) out["overlap"] = {{"share", costs.overlap}, {"pairs", costs.overlapped_pairs}};
  return out.dump();
}

MeasuredCosts parse_measured_costs(const std::string& json_object, const std::string& where) {
  const nlohmann::json doc = nlohmann::json::parse(json_object, nullptr, /*allow_exceptions=*/false);
  TWOBP_CHECK(doc.is_object(), UsageError, "{}: not a JSON object (expected measured costs: \"communication_ms\" and "
              "\"costs_ms\", as a result of `twobp_bench pipeline --json` has)", where);
  auto number = [&](const nlohmann::json& j, const std::string& what) {
    TWOBP_CHECK(j.is_number(), UsageError, "{}: {} must be a number (ms), got {}", where, what, j.dump());
    detail::check_cost(j.get<double>(), where, what, detail::kMaxCostMs, "time in ms");
    return j.get<double>();
  };
  TWOBP_CHECK(doc.contains("communication_ms") && doc.contains("costs_ms") && doc["costs_ms"].is_object(),
              UsageError, "{}: needs \"communication_ms\" and a \"costs_ms\" object (F, I, W, B lists per stage)",
              where);
  const nlohmann::json& costs = doc["costs_ms"];
  auto list = [&](const char* key) {
    std::vector<double> out;
    if (!costs.contains(key)) return out;
    TWOBP_CHECK(costs[key].is_array(), UsageError, "{}: costs_ms.{} must be a list (one number per stage)", where, key);
    for (std::size_t s = 0; s < costs[key].size(); ++s) {
      out.push_back(number(costs[key][s], fmt::format("costs_ms.{}[{}]", key, s)));
    }
    return out;
  };
  MeasuredCosts c;
  c.communication = number(doc["communication_ms"], "communication_ms");
  TWOBP_CHECK(costs.contains("F"), UsageError, "{}: costs_ms has no \"F\" (forward cost per stage)", where);
  c.forward = list("F");
  const std::size_t S = c.forward.size();
  TWOBP_CHECK(S > 0, UsageError, "{}: costs_ms.F is empty (no stages)", where);
  std::pair<const char*, std::vector<double>*> rest[] = {
      {"I", &c.backward_input}, {"W", &c.backward_weight}, {"B", &c.backward}, {"R", &c.recompute},
      {"W0", &c.backward_weight_fixed}};
  for (auto& [key, into] : rest) {
    *into = list(key);
    const bool optional_empty = into->empty() && !costs.contains(key);
    const bool stays_empty = into == &c.recompute || into == &c.backward_weight_fixed;  // "none", not "0 per stage"
    if (optional_empty && !stays_empty) into->assign(S, 0.0);
    TWOBP_CHECK(optional_empty || into->size() == S, UsageError,
                "{}: costs_ms.{} has {} stages, costs_ms.F has {}; every list needs one entry per stage", where, key,
                into->size(), S);
  }
  if (doc.contains("overlap")) {
    const nlohmann::json& o = doc["overlap"];
    TWOBP_CHECK(o.is_object() && o.contains("share") && o.contains("pairs") && o["pairs"].is_number_integer() &&
                    o["pairs"].get<int64_t>() > 0,
                UsageError, "{}: \"overlap\" must be {{\"share\": s, \"pairs\": n}} with n > 0, got {}", where,
                o.dump());
    const nlohmann::json& share = o["share"];
    TWOBP_CHECK(share.is_number() && share.get<double>() >= 0.0 && share.get<double>() <= 1.0, UsageError,
                "{}: overlap.share must be a number in [0, 1], got {}", where, share.dump());
    c.overlap = share.get<double>();
    c.overlapped_pairs = o["pairs"].get<int>();
  }
  return c;
}

}  // namespace twobp
