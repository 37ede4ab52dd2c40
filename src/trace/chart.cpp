#include "twobp/trace/chart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "util/xml.h"

namespace twobp {
namespace {

// A value with about 3 significant digits, thousands as "k" (bars are narrow).
std::string short_value(double v) {
  if (v >= 1e6) return fmt::format("{:.3g}M", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.0f}k", v / 1e3);
  if (v >= 1e3) return fmt::format("{:.3g}k", v / 1e3);
  return fmt::format("{:.3g}", v);
}

// 1, 2 or 5 times a power of ten, so that about 5 grid lines cover [0, max].
double nice_step(double max) {
  if (!(max > 0)) return 1;
  const double raw = max / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0}) {
    if (raw <= f * mag) return f * mag;
  }
  return 10 * mag;
}

bool drawable(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

std::string bar_chart_svg(const std::string& title, const std::string& unit, const std::vector<std::string>& series,
                          const std::vector<BarGroup>& groups) {
  static const char* kColours[] = {"#7f8c9a", "#2e86de", "#e67e22", "#27ae60", "#8e44ad"};
  const int n_series = std::max<int>(1, static_cast<int>(series.size()));
  const double bar_w = 44, bar_gap = 4, group_gap = 36;
  const double group_w = n_series * bar_w + (n_series - 1) * bar_gap;
  const double left = 80, right = 20, top = 70, plot_h = 300, bottom = 60;
  // Wide enough for the bars, the title (15 px bold: ~9 px a character) and the legend (as laid out below), so
  // that neither is clipped when there are only one or two groups.
  double legend_w = 0;
  for (const auto& name : series) legend_w += 30 + 8.0 * static_cast<double>(name.size());
  const double width = std::max({420.0, left + right + groups.size() * (group_w + group_gap) + group_gap,
                                 left + right + 9.0 * static_cast<double>(title.size()), left + right + legend_w});
  const double height = top + plot_h + bottom;

  double max = 0;
  for (const auto& g : groups) {
    for (double v : g.values) {
      if (drawable(v)) max = std::max(max, v);
    }
  }
  const double step = nice_step(max);
  const double axis_max = max > 0 ? std::ceil(max * 1.08 / step) * step : 1;
  auto y_of = [&](double v) { return top + plot_h * (1 - v / axis_max); };

  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" viewBox=\"0 0 {0:.0f} {1:.0f}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      width, height);
  s += fmt::format("<text x=\"{:.0f}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n", left,
                   detail::xml_escaped(title));
  // Legend.
  double lx = left;
  for (int k = 0; k < static_cast<int>(series.size()); ++k) {
    s += fmt::format("<rect x=\"{:.0f}\" y=\"34\" width=\"14\" height=\"14\" fill=\"{}\"/>", lx, kColours[k % 5]);
    s += fmt::format("<text x=\"{:.0f}\" y=\"45\">{}</text>\n", lx + 19, detail::xml_escaped(series[k]));
    lx += 30 + 8.0 * series[k].size();
  }
  // Grid and value axis.
  for (double v = 0; v <= axis_max * (1 + 1e-9); v += step) {
    const double y = y_of(v);
    s += fmt::format("<line x1=\"{:.0f}\" y1=\"{:.1f}\" x2=\"{:.0f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>", left, y,
                     width - right, y);
    s += fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", left - 6, y + 4,
                     short_value(v));
  }
  s += fmt::format("<text transform=\"translate(18,{:.0f}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
                   top + plot_h / 2, detail::xml_escaped(unit));
  s += fmt::format("<line x1=\"{0:.0f}\" y1=\"{1:.0f}\" x2=\"{2:.0f}\" y2=\"{1:.0f}\" stroke=\"#333\"/>\n", left,
                   top + plot_h, width - right);
  // Bars.
  double x = left + group_gap;
  for (const auto& g : groups) {
    double group_top = top + plot_h;
    for (int k = 0; k < static_cast<int>(g.values.size()) && k < n_series; ++k) {
      const double v = g.values[k], bx = x + k * (bar_w + bar_gap);
      if (!drawable(v)) continue;
      const double y = y_of(v);
      group_top = std::min(group_top, y);
      s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.0f}\" height=\"{:.1f}\" fill=\"{}\"><title>{} {}: "
                       "{:.6g} {}</title></rect>",
                       bx, y, bar_w, top + plot_h - y, kColours[k % 5], detail::xml_escaped(g.name),
                       k < static_cast<int>(series.size()) ? detail::xml_escaped(series[k]) : "", v,
                       detail::xml_escaped(unit));
      s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" font-size=\"11\">{}</text>\n",
                       bx + bar_w / 2, y - 4, short_value(v));
    }
    if (!g.label.empty()) {
      s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" font-weight=\"bold\">{}</text>\n",
                       x + group_w / 2, group_top - 20, detail::xml_escaped(g.label));
    }
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" text-anchor=\"middle\">{}</text>\n", x + group_w / 2,
                     top + plot_h + 18, detail::xml_escaped(g.name));
    x += group_w + group_gap;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace twobp
