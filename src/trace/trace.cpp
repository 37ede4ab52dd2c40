#include "twobp/trace/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "twobp/metrics/metrics.h"

namespace twobp {

double Trace::busy_us() const {
  double busy = 0.0;
  for (const auto& e : events) {
    if (is_compute(e.action.type)) busy += e.end_us - e.start_us;
  }
  return busy;
}

double Trace::idle_fraction() const { return metrics::bubble_fraction(std::vector<double>{busy_us()}, step_us); }

double bubble_fraction(const std::vector<Trace>& ranks) {
  double step = 0.0;
  std::vector<double> busy;
  for (const auto& t : ranks) {
    step = std::max(step, t.step_us);
    busy.push_back(t.busy_us());
  }
  return metrics::bubble_fraction(busy, step);
}

std::string to_chrome_trace(const std::vector<Trace>& ranks) {
  nlohmann::json events = nlohmann::json::array();
  for (const auto& t : ranks) {
    for (const auto& e : t.events) {
      events.push_back({{"name", describe(e.action)},
                        {"cat", to_string(e.action.type)},
                        {"ph", "X"},
                        {"ts", e.start_us},
                        {"dur", e.end_us - e.start_us},
                        {"pid", 0},
                        {"tid", e.rank}});
      // The recomputed forward opens its I or B: a nested slice at its start.
      if (e.recompute_us > 0) {
        events.push_back({{"name", "recompute " + describe(e.action)},
                          {"cat", "recompute"},
                          {"ph", "X"},
                          {"ts", e.start_us},
                          {"dur", std::min(e.recompute_us, e.end_us - e.start_us)},
                          {"pid", 0},
                          {"tid", e.rank}});
      }
    }
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

namespace {
const char* colour(ActionType t) {
  switch (t) {
    case ActionType::kForward: return "#4e79a7";
    case ActionType::kBackwardInput: return "#f28e2b";
    case ActionType::kBackwardWeight: return "#59a14f";
    case ActionType::kBackward: return "#e15759";
    default: return "#bab0ac";
  }
}
}  // namespace

std::string to_svg(const std::vector<Trace>& ranks, const std::string& title) {
  const double width = 1200.0, row = 34.0, left = 70.0, top = 40.0;
  double step = 1.0;
  for (const auto& t : ranks) step = std::max(step, t.step_us);
  const double scale = (width - left - 20.0) / step;
  const double height = top + row * static_cast<double>(ranks.size()) + 40.0;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
      width, height, left, title);
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const double y = top + row * static_cast<double>(r);
    svg += fmt::format("<text x=\"8\" y=\"{:.1f}\">rank {}</text>\n", y + row / 2 + 4, r);
    svg += fmt::format("<rect x=\"{}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
                       "stroke=\"#ddd\"/>\n",
                       left, y + 2, step * scale, row - 4);
    for (const auto& e : ranks[r].events) {
      if (!is_compute(e.action.type)) continue;
      const double x = left + e.start_us * scale, w = std::max(1.0, (e.end_us - e.start_us) * scale);
      std::string label = to_string(e.action.type);
      for (std::size_t k = 0; k < e.action.micro_batches.size() && k < 3; ++k) {
        label += (k ? "," : "") + std::to_string(e.action.micro_batches[k]);
      }
      if (e.action.micro_batches.size() > 3) label += "..";
      svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                         "stroke=\"white\"><title>{} ({:.0f} us)</title></rect>\n",
                         x, y + 2, w, row - 4, colour(e.action.type), describe(e.action), e.end_us - e.start_us);
      if (w > 7.0 * static_cast<double>(label.size())) {
        svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"white\">{}</text>\n", x + 3, y + row / 2 + 4,
                           label);
      }
    }
  }
  const double ly = top + row * static_cast<double>(ranks.size()) + 20;
  double lx = left;
  for (ActionType t : {ActionType::kForward, ActionType::kBackward, ActionType::kBackwardInput,
                       ActionType::kBackwardWeight}) {
    svg += fmt::format("<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.0f}\" "
                       "y=\"{:.0f}\">{}</text>\n",
                       lx, ly - 10, colour(t), lx + 16, ly, to_string(t));
    lx += 60;
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace twobp
