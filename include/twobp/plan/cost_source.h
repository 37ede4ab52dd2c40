#pragma once
// Where a simulation's per-stage costs come from: per-rank constants, or one result of a run document (measured
// costs, mapped onto any other placement), and the data-parallel all-reduces a ring adds to them. What
// `twobp_bench simulate` prices every schedule with; docs/BENCHMARKS.md ("simulate") describes the rules.
//
//   CostSource src(doc, 0, "pipeline.json");                 // or CostSource(RankCosts{...}, overlap)
//   std::string rule;
//   CostModel costs = src.costs_for(schedule, &rule);        // "per-stage", "per-rank / v" or "mean-rank / v"
//   add_data_parallel(costs, schedule, gradient_bytes, RingLink{...});
//   simulate(schedule, costs);

#include <string>
#include <vector>

#include "twobp/plan/measure.h"
#include "twobp/plan/record.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"  // RankCosts

namespace twobp {

class CostSource {
 public:
  /// Per-rank constants (RankCosts::per_stage) and the overlapped pairs' hidden share (CostModel::overlap).
  /// UsageError "CostSource: per-rank costs: B (RankCosts.backward) is ..." when a cost is NaN, infinite, negative
  /// or above 1e9 ms, when B is more than 10 % below max(I, W0 + W) (a fused backward does the work of both), or
  /// when overlap is outside [0, 1].
  explicit CostSource(const RankCosts& costs, double overlap = 0.0);
  /// Result `index` of `doc` (`where`: the document's file, for messages): its costs, the mode it did not run
  /// taken from its partner (complete_costs), on the placement it ran. `overlap` >= 0 replaces what the run's
  /// overlapped pairs hid (NaN is refused). UsageError naming "<where>: result <index>" when `index` is out of
  /// range, the record's or its partner's costs are refused by check_measured_costs (a document built in code, not
  /// read), complete_costs refuses them (lists of other lengths), or the record's schedule does not have as many
  /// stages as it has costs.
  CostSource(const RunDocument& doc, std::size_t index, const std::string& where, double overlap = -1.0);

  /// The costs of `target`'s stages: measured costs mapped by costs_for_placement, per-rank constants / v
  /// (RankCosts::per_stage, rule "per-rank / v"). With `recompute`, every I and B first re-runs its stage's forward (recompute = forward).
  CostModel costs_for(const Schedule& target, bool recompute = false, std::string* rule = nullptr) const;

  bool measured() const { return measured_; }
  /// The per-rank constants (measured: only communication is meaningful).
  const RankCosts& rank_costs() const { return rank_; }
  double overlap() const { return overlap_; }
  /// One line: the costs and where they come from (e.g. "pipeline.json result 1 (1f1b 2bp p=2 m=4 v=1), ...").
  const std::string& description() const { return description_; }

 private:
  bool measured_ = false;
  RankCosts rank_;
  double overlap_ = 0.0;
  MeasuredCosts costs_;             // measured: per stage, completed by the partner rule
  std::vector<int> stage_to_rank_;  // measured: the placement that measured them
  std::string description_;
};

/// A data-parallel group's ring all-reduce link, per rank.
struct RingLink {
  int replicas = 1;
  double bytes_per_s = 0.0;
  double latency_s = 0.0;
  int buckets = 1;       ///< buckets per stage (CostModel::data_parallel_buckets), each paying the ring's latency
  bool overlap = true;   ///< CostModel::overlap_data_parallel
};

/// Sets `costs`' data-parallel terms for `schedule`: stage s all-reduces `gradient_bytes[s]` in `link.buckets`
/// buckets, each a ring all-reduce over `link.replicas` (metrics::ring_all_reduce_seconds), in ms. Returns the
/// largest sum over a rank's stages. UsageError when gradient_bytes does not have one entry per stage, an entry is
/// NaN, infinite or negative (naming "gradient_bytes[<stage>]"), link.latency_s is not a finite time >= 0, or
/// link.bytes_per_s is not finite and > 0 with replicas > 1.
double add_data_parallel(CostModel& costs, const Schedule& schedule, const std::vector<double>& gradient_bytes,
                         const RingLink& link);

}  // namespace twobp
