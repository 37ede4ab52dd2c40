#include "twobp/trace/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "twobp/metrics/metrics.h"
#include "trace/palette.h"
#include "util/xml.h"

namespace twobp {

bool ran_as_pair(const std::vector<TraceEvent>& events, std::size_t k) {
  const TraceEvent& e = events.at(k);
  return e.action.overlapped_with_next && e.action.type == ActionType::kForward && k + 1 < events.size() &&
         events[k + 1].start_us == e.start_us && events[k + 1].end_us == e.end_us;
}

double Trace::busy_us() const {
  double busy = 0.0;
  for (std::size_t k = 0; k < events.size(); ++k) {
    const TraceEvent& e = events[k];
    if (is_compute(e.action.type)) busy += e.end_us - e.start_us;
    if (ran_as_pair(events, k)) ++k;  // its second part spans the same time
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
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "twobp pipeline"}}}});
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const int tid = static_cast<int>(r);
    // Metadata events: the track's name and its place (rank order, not the order tracks first appear).
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", tid},
                      {"args", {{"name", fmt::format("rank {}", r)}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", tid},
                      {"args", {{"sort_index", tid}}}});
    for (const auto& e : ranks[r].events) {
      events.push_back({{"name", describe(e.action)},
                        {"cat", to_string(e.action.type)},
                        {"ph", "X"},
                        {"ts", e.start_us},
                        {"dur", e.end_us - e.start_us},
                        {"pid", 0},
                        {"tid", tid}});
      // The recomputed forward opens its I or B: a nested slice at its start.
      if (e.recompute_us > 0) {
        events.push_back({{"name", "recompute " + describe(e.action)},
                          {"cat", "recompute"},
                          {"ph", "X"},
                          {"ts", e.start_us},
                          {"dur", std::min(e.recompute_us, e.end_us - e.start_us)},
                          {"pid", 0},
                          {"tid", tid}});
      }
    }
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

using detail::action_colour;
using detail::time_axis_ms;
using detail::xml_escaped;

std::string to_svg(const std::vector<Trace>& ranks, const std::string& title) {
  const double width = 1200.0, row = 34.0, left = 70.0, top = 40.0, axis = 34.0;
  double step = 1.0;
  for (const auto& t : ranks) step = std::max(step, t.step_us);
  const double scale = (width - left - 20.0) / step;
  const double rows_end = top + row * static_cast<double>(ranks.size());
  const double height = rows_end + axis + 40.0;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
      width, height, left, xml_escaped(title));
  bool several_chunks = false;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const double y = top + row * static_cast<double>(r);
    // A rank's chunks (its stages, in order) told apart by shade: the first in full colour, later ones lighter.
    std::vector<int> stages;
    for (const auto& e : ranks[r].events) {
      if (is_compute(e.action.type) && std::find(stages.begin(), stages.end(), e.action.stage) == stages.end()) {
        stages.push_back(e.action.stage);
      }
    }
    std::sort(stages.begin(), stages.end());
    several_chunks = several_chunks || stages.size() > 1;
    svg += fmt::format("<text x=\"8\" y=\"{:.1f}\">rank {}</text>\n", y + row / 2 + 4, r);
    svg += fmt::format("<rect x=\"{}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
                       "stroke=\"#ddd\"/>\n",
                       left, y + 2, step * scale, row - 4);
    for (const auto& e : ranks[r].events) {
      if (!is_compute(e.action.type)) continue;
      const double x = left + e.start_us * scale, w = std::max(1.0, (e.end_us - e.start_us) * scale);
      const auto chunk = std::find(stages.begin(), stages.end(), e.action.stage) - stages.begin();
      const double opacity = std::max(0.35, 1.0 - 0.35 * static_cast<double>(chunk));
      std::string label = to_string(e.action.type);
      for (std::size_t k = 0; k < e.action.micro_batches.size() && k < 3; ++k) {
        label += (k ? "," : "") + std::to_string(e.action.micro_batches[k]);
      }
      if (e.action.micro_batches.size() > 3) label += "..";
      svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                         "fill-opacity=\"{:.2f}\" stroke=\"white\"><title>{} ({:.0f} us)</title></rect>\n",
                         x, y + 2, w, row - 4, action_colour(e.action.type), opacity, xml_escaped(describe(e.action)),
                         e.end_us - e.start_us);
      if (w > 7.0 * static_cast<double>(label.size())) {
        svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"{}\">{}</text>\n", x + 3, y + row / 2 + 4,
                           chunk == 0 ? "white" : "black", label);
      }
    }
  }
  svg += time_axis_ms(left, rows_end, step, scale);  // the step's wall time
  const double ly = rows_end + axis + 20;
  double lx = left;
  for (ActionType t : {ActionType::kForward, ActionType::kBackward, ActionType::kBackwardInput,
                       ActionType::kBackwardWeight}) {
    svg += fmt::format("<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.0f}\" "
                       "y=\"{:.0f}\">{}</text>\n",
                       lx, ly - 10, action_colour(t), lx + 16, ly, to_string(t));
    lx += 60;
  }
  if (several_chunks) {
    svg += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\">lighter: a rank's later chunks (higher stages)</text>\n",
                       lx + 10, ly);
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace twobp
