#pragma once
// The one rule for a cost, time, size or budget entering schedule/, plan/ and metrics/ (issue 69): a finite number
// >= 0 -- at most kMaxCostMs where it is a time in milliseconds -- and, for the per-rank costs a user states, a fused
// backward B no cheaper than the larger of its parts, I and a W of one micro-batch, less kFusedBackwardTolerance.
// Every entry point calls these where the number enters, naming the field and where it came from; the public
// headers say which entry refuses what.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/schedule/simulate.h"

namespace twobp::detail {

inline constexpr double kNoBound = std::numeric_limits<double>::infinity();
/// The largest time in ms a millisecond entry takes: 1e9 ms (11.6 days for one action), the programs' bound on
/// --f/--i/--w/--b. Beyond it a plan means nothing, and near 1e308 sums of costs overflow.
inline constexpr double kMaxCostMs = 1e9;
/// How far (a share) B may be below max(I, W of one micro-batch): measurement noise, no more.
inline constexpr double kFusedBackwardTolerance = 0.1;

/// UsageError "<where>: <field> is <value>, expected a finite <what> >= 0[ and <= max]" unless `value` is finite,
/// >= 0 and <= max.
inline void check_cost(double value, const std::string& where, const std::string& field, double max = kNoBound,
                       const char* what = "time") {
  if (std::isfinite(value) && value >= 0.0 && value <= max) return;
  throw UsageError(fmt::format("{}: {} is {}, expected a finite {} >= 0{}", where, field, value, what,
                               max < kNoBound ? fmt::format(" and <= {:g}", max) : std::string()));
}

/// The same for a number where 0 means nothing (a bandwidth, a count of steps): finite and > 0.
inline void check_positive(double value, const std::string& where, const std::string& field, const char* what) {
  if (std::isfinite(value) && value > 0.0) return;
  throw UsageError(fmt::format("{}: {} is {}, expected a finite {} > 0", where, field, value, what));
}

/// check_cost of every entry, each named "<field>[<stage>]".
inline void check_costs(const std::vector<double>& values, const std::string& where, const std::string& field,
                        double max = kNoBound, const char* what = "time") {
  for (std::size_t s = 0; s < values.size(); ++s) {
    check_cost(values[s], where, fmt::format("{}[{}]", field, s), max, what);
  }
}

/// check_costs of several named lists (e.g. {"CostModel.forward", &costs.forward}).
inline void check_cost_lists(std::initializer_list<std::pair<const char*, const std::vector<double>*>> lists,
                             const std::string& where, double max = kNoBound) {
  for (const auto& [field, values] : lists) check_costs(*values, where, field, max);
}

/// Every time `costs` gives (F, I, W, W0, B, recompute, communication, per action, data-parallel reductions):
/// check_costs, each named "CostModel.<member>[<stage>]" (the scalars "CostModel.<member>"). The lists' sizes are the
/// caller's to check. Not the B rule (simulate() and synthesize() take any costs >= 0, a B below I as a what-if;
/// CostSource holds the programs' per-rank costs to it).
inline void check_cost_model(const CostModel& costs, const std::string& where) {
  check_cost_lists({{"CostModel.forward", &costs.forward},
                    {"CostModel.backward_input", &costs.backward_input},
                    {"CostModel.backward_weight", &costs.backward_weight},
                    {"CostModel.backward_weight_fixed", &costs.backward_weight_fixed},
                    {"CostModel.backward", &costs.backward},
                    {"CostModel.recompute", &costs.recompute},
                    {"CostModel.data_parallel_reduce", &costs.data_parallel_reduce}},
                   where);
  check_cost(costs.communication, where, "CostModel.communication");
  check_cost(costs.per_action, where, "CostModel.per_action");
}

/// A fused backward computes the input gradient (I) and the weight gradients (W) at once, so it costs at least the
/// larger of them: UsageError "<where>: <who>B is <b>, below max(I, W) = ..." unless b >= max(i, w1) * (1 -
/// kFusedBackwardTolerance), with `w1` a W of one micro-batch (W0 + W). Not checked when b or both parts are 0 (not
/// measured). `who`: "" or "stage 3: ".
inline void check_fused_backward(double b, double i, double w1, const std::string& where, const std::string& who) {
  const double parts = std::max(i, w1);
  if (b <= 0.0 || parts <= 0.0 || b >= parts * (1.0 - kFusedBackwardTolerance)) return;
  throw UsageError(fmt::format("{}: {}B is {:g}, below max(I, W) = max({:g}, {:g}) by more than the {:g} % "
                               "tolerance: a fused backward computes the input gradient (I) and the weight gradients "
                               "(W) at once, so it costs at least the larger of them",
                               where, who, b, i, w1, 100.0 * kFusedBackwardTolerance));
}

}  // namespace twobp::detail
