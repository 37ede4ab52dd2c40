#include "twobp/plan/cost_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "twobp/error.h"
#include "twobp/metrics/metrics.h"
#include "twobp/schedule/registry.h"
#include "util/check.h"
#include "util/cost_check.h"

namespace twobp {

CostSource::CostSource(const RankCosts& costs, double overlap) : rank_(costs), overlap_(overlap) {
  const RankCosts& c = rank_;
  const std::string where = "CostSource: per-rank costs";
  const std::pair<const char*, double> fields[] = {{"F (RankCosts.forward)", c.forward},
                                                   {"I (RankCosts.backward_input)", c.backward_input},
                                                   {"W (RankCosts.backward_weight)", c.backward_weight},
                                                   {"B (RankCosts.backward)", c.backward},
                                                   {"W0 (RankCosts.backward_weight_fixed)", c.backward_weight_fixed},
                                                   {"comm (RankCosts.communication)", c.communication}};
  for (const auto& [field, ms] : fields) detail::check_cost(ms, where, field, detail::kMaxCostMs, "time in ms");
  detail::check_fused_backward(c.backward, c.backward_input, c.backward_weight_fixed + c.backward_weight, where, "");
  TWOBP_CHECK(overlap >= 0.0 && overlap <= 1.0, UsageError, "CostSource: overlap must be in [0, 1], got {}", overlap);
  description_ = fmt::format("per rank: F={:g} I={:g} W={:.4g} B={:g}{} comm={:g}{}", c.forward, c.backward_input,
                             c.backward_weight, c.backward,
                             c.backward_weight_fixed > 0 ? fmt::format(" W0={:.4g}", c.backward_weight_fixed) : "",
                             c.communication, overlap > 0 ? fmt::format(" overlap={:g}", overlap) : "");
}

CostSource::CostSource(const RunDocument& doc, std::size_t index, const std::string& where, double overlap)
    : measured_(true) {
  TWOBP_CHECK(index < doc.results.size(), UsageError, "{}: result {} out of range (the file has {} results)", where,
              index, doc.results.size());
  const RunRecord& r = doc.results[index];
  const std::string result = fmt::format("{}: result {}", where, index);
  const RunRecord* partner = find_partner(doc, index);
  check_measured_costs(r.costs, result);  // a document built in code has not been through the reader
  if (partner != nullptr) {
    check_measured_costs(partner->costs, fmt::format("{}: result {} (the partner of result {})", where,
                                                     partner - doc.results.data(), index));
  }
  std::string partner_note;
  try {
    costs_ = complete_costs(r, partner, &partner_note);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", result, e.what()));
  }
  rank_.communication = costs_.communication;
  overlap_ = overlap >= 0 || std::isnan(overlap) ? overlap : costs_.overlap;  // < 0: the run's; NaN refused below
  TWOBP_CHECK(overlap_ >= 0.0 && overlap_ <= 1.0, UsageError, "{}: overlap must be in [0, 1], got {}", result,
              overlap_);
  // The measured placement: the measured schedule regenerated (cheap) for its stage -> rank map.
  stage_to_rank_ = make_schedule(r.schedule, ScheduleOptions{r.p, r.m, r.v, BackwardMode::kSplit}).stage_to_rank;
  TWOBP_CHECK(static_cast<int>(stage_to_rank_.size()) == costs_.num_stages(), UsageError,
              "{}: {} stage costs, but {} p={} v={} has {} stages", result, costs_.num_stages(),
              r.schedule, r.p, r.v, stage_to_rank_.size());
  description_ = fmt::format("{} result {} ({} {} p={} m={} v={}),{} comm={:g}{}", where, index, r.schedule,
                             to_string(r.mode), r.p, r.m, r.v, partner_note, rank_.communication,
                             overlap_ > 0 ? fmt::format(" overlap={:.3g}", overlap_) : "");
}

CostModel CostSource::costs_for(const Schedule& target, bool recompute, std::string* rule) const {
  CostModel c = measured_ ? costs_for_placement(costs_, stage_to_rank_, target, rule)
                          : rank_.per_stage(target.num_stages, target.num_ranks);
  if (!measured_ && rule) *rule = "per-rank / v";
  c.overlap = overlap_;
  if (recompute) c.recompute = c.forward;  // the re-run forward costs what F costs
  return c;
}

double add_data_parallel(CostModel& costs, const Schedule& schedule, const std::vector<double>& gradient_bytes,
                         const RingLink& link) {
  TWOBP_CHECK(static_cast<int>(gradient_bytes.size()) == schedule.num_stages, UsageError,
              "add_data_parallel: {} gradient sizes for {} stages", gradient_bytes.size(), schedule.num_stages);
  TWOBP_CHECK(link.buckets >= 1 && link.replicas >= 1, UsageError,
              "add_data_parallel: buckets and replicas must be >= 1, got {} and {}", link.buckets, link.replicas);
  detail::check_costs(gradient_bytes, "add_data_parallel", "gradient_bytes", detail::kNoBound, "size in bytes");
  detail::check_cost(link.latency_s, "add_data_parallel", "RingLink.latency_s");
  if (link.replicas > 1) {
    detail::check_positive(link.bytes_per_s, "add_data_parallel", "RingLink.bytes_per_s", "bandwidth in bytes/s");
  }
  costs.data_parallel_reduce.clear();
  for (double bytes : gradient_bytes) {
    costs.data_parallel_reduce.push_back(
        link.buckets * 1e3 *
        metrics::ring_all_reduce_seconds(bytes / link.buckets, link.replicas, link.bytes_per_s, link.latency_s));
  }
  costs.overlap_data_parallel = link.overlap;
  costs.data_parallel_buckets = link.buckets;
  double per_rank = 0.0;
  for (int r = 0; r < schedule.num_ranks; ++r) {
    double sum = 0.0;
    for (int s : schedule.stages_of(r)) sum += costs.data_parallel_reduce[s];
    per_rank = std::max(per_rank, sum);
  }
  return per_rank;
}

}  // namespace twobp
