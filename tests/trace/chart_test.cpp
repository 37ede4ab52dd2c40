// bar_chart_svg (twobp/trace/chart.h): one bar per drawable value with its tooltip, nothing for values that cannot
// be drawn, every text escaped, an axis that passes the largest value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "twobp/trace/chart.h"

namespace twobp {
namespace {

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

TEST(BarChart, OneBarPerDrawableValueWithItsTooltip) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<BarGroup> groups{{"1f1b", {100.0, 150.0}, "2bp x1.500"},
                                     {"zb-v", {0.0, 80.0}, ""},       // standard not run: no bar
                                     {"gpipe", {nan, -3.0}, "none"}};  // nothing drawable
  const std::string svg = bar_chart_svg("throughput", "tokens/s", {"standard", "2bp"}, groups);
  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("</svg>\n"), std::string::npos);
  EXPECT_EQ(count(svg, "<title>"), 3);
  EXPECT_NE(svg.find("<title>1f1b standard: 100 tokens/s</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>1f1b 2bp: 150 tokens/s</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>zb-v 2bp: 80 tokens/s</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">2bp x1.500</text>"), std::string::npos) << "the group's label";
  for (const char* name : {"1f1b", "zb-v", "gpipe", "standard", "2bp", "tokens/s", "throughput"}) {
    EXPECT_NE(svg.find(std::string(">") + name + "</text>"), std::string::npos) << name;
  }
  // The value axis's top grid line is at or above the largest bar: no bar taller than the plot.
  const std::regex tick(R"(text-anchor="end">([0-9.]+)(k?)</text>)");
  double top = 0.0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tick); it != std::sregex_iterator(); ++it) {
    top = std::max(top, std::stod((*it)[1]) * ((*it)[2] == "k" ? 1e3 : 1.0));
  }
  EXPECT_GE(top, 150.0);
}

TEST(BarChart, EscapesEveryText) {
  const std::string svg =
      bar_chart_svg("a <b> & \"c\"", "x/'s'", {"s<1>"}, {{"g&h", {2.0}, "<label>"}});
  for (const char* raw : {"<b>", "& \"c\"", "s<1>", "g&h", "<label>", "'s'"}) {
    EXPECT_EQ(svg.find(raw), std::string::npos) << raw << " unescaped";
  }
  for (const char* escaped : {"a &lt;b&gt; &amp; &quot;c&quot;", "s&lt;1&gt;", "g&amp;h", "&lt;label&gt;",
                              "x/&apos;s&apos;"}) {
    EXPECT_NE(svg.find(escaped), std::string::npos) << escaped;
  }
}

TEST(BarChart, NoDrawableValueStillGivesADocument) {
  const std::string svg = bar_chart_svg("empty", "samples/s", {"standard", "2bp"}, {{"1f1b", {0.0, 0.0}, ""}});
  EXPECT_EQ(count(svg, "<title>"), 0);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(bar_chart_svg("none", "u", {}, {}).rfind("<svg ", 0), 0u);
}

}  // namespace
}  // namespace twobp
