#pragma once
// Whether a list of per-stage numbers (costs, bytes) holds a measurement: the planners read "no positive entry" as
// "not measured".

#include <algorithm>
#include <vector>

namespace twobp::detail {

/// Some entry is > 0.
inline bool any_positive(const std::vector<double>& v) {
  return std::any_of(v.begin(), v.end(), [](double x) { return x > 0.0; });
}

/// There is an entry, and every entry is > 0.
inline bool every_positive(const std::vector<double>& v) {
  return !v.empty() && std::all_of(v.begin(), v.end(), [](double x) { return x > 0.0; });
}

}  // namespace twobp::detail
