#pragma once
// Private: what the library's SVG pictures share -- one colour per action type, axis ticks.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

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

// A time axis in milliseconds under a picture's rows: a line from x = `left` over `span_us` at `scale` pixels per
// microsecond, at height `y`, with ticks at 1, 2 or 5 x 10^k and a "time (ms)" label.
inline std::string time_axis_ms(double left, double y, double span_us, double scale) {
  const double span_ms = span_us / 1000.0, tick = nice_tick(span_ms, 8);
  std::string svg = fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#555\"/>\n",
                                left, y + 4, left + span_us * scale, y + 4);
  for (double t = 0; t <= span_ms * (1 + 1e-9); t += tick) {
    const double x = left + t * 1000.0 * scale;
    svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#555\"/>"
                       "<text x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\">{4:g}</text>\n",
                       x, y + 4, y + 9, y + 21, t);
  }
  return svg + fmt::format("<text x=\"8\" y=\"{:.1f}\">time (ms)</text>\n", y + 21);
}

}  // namespace twobp::detail
