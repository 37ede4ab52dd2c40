#pragma once
// Private: what the library's SVG pictures share -- one colour per action type, axis ticks.

#include <algorithm>
#include <cmath>

#include "twobp/schedule/action.h"

namespace twobp::detail {

inline const char* action_colour(ActionType t) {
  switch (t) {
    case ActionType::kForward: return "#4e79a7";
    case ActionType::kBackwardInput: return "#f28e2b";
    case ActionType::kBackwardWeight: return "#59a14f";
    case ActionType::kBackward: return "#e15759";
    default: return "#bab0ac";
  }
}

// A tick spacing of 1, 2 or 5 times a power of ten giving about `ticks` ticks over `span`.
inline double nice_tick(double span, int ticks) {
  const double raw = span / std::max(1, ticks);
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10.0 * power;
}

}  // namespace twobp::detail
