#pragma once
// A grouped bar chart as an SVG document (no dependency, no torch), as `twobp_bench pipeline --chart` draws
// throughput: per group (a schedule), one bar per series (standard, 2BP) side by side, the value on each bar, a
// legend and an optional label above each group (the speedup).

#include <string>
#include <vector>

namespace twobp {

struct BarGroup {
  std::string name;            ///< shown under the group (the schedule)
  std::vector<double> values;  ///< one per series; <= 0 or non-finite: no bar (e.g. that mode was not run)
  std::string label;           ///< shown above the group (e.g. "2BP ×1.23"); may be empty
};

/// SVG document: `series` names the bars of every group (legend, in order), `unit` labels the value axis, which
/// starts at 0 and passes the largest drawn value. Every text is XML-escaped; each bar carries a <title> tooltip
/// "<group> <series>: <value> <unit>".
std::string bar_chart_svg(const std::string& title, const std::string& unit, const std::vector<std::string>& series,
                          const std::vector<BarGroup>& groups);

}  // namespace twobp
