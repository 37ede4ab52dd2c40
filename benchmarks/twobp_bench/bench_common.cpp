#include "bench_common.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>

#include "twobp/metrics/metrics.h"

namespace twobp::bench {

Json to_json(const Summary& s) {
  return Json{{"min", s.min}, {"p25", s.p25}, {"median", s.median}, {"p75", s.p75}, {"max", s.max},
              {"n", s.count}};
}

Json spread(const Series& series) {
  Json out = Json::object();
  for (const auto& [name, samples] : series.all()) out[name] = to_json(summarize(samples));
  return out;
}

Json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return Json::parse(in);  // throws on malformed input
}

std::vector<std::string> check_numbers(const Json& json, const std::vector<std::string>& paths, bool positive) {
  std::vector<std::string> problems;
  for (const auto& path : paths) {
    const Json* node = &json;
    std::stringstream parts(path);
    std::string key;
    bool found = true;
    while (std::getline(parts, key, '/')) {
      if (!node->is_object() || !node->contains(key)) {
        found = false;
        break;
      }
      node = &(*node)[key];
    }
    if (!found) {
      problems.push_back(path + ": missing");
    } else if (!node->is_number()) {
      problems.push_back(path + ": not a number (" + node->dump() + ")");
    } else if (!std::isfinite(node->get<double>()) || (positive && node->get<double>() <= 0)) {
      problems.push_back(path + ": bad value " + node->dump());
    }
  }
  return problems;
}

void print_table(std::ostream& os, const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (std::size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (std::size_t i = 0; i < rows[r].size(); ++i) {
      // First column left-aligned (names), the rest right-aligned (numbers).
      if (i == 0) {
        os << std::left << std::setw(static_cast<int>(width[i])) << rows[r][i];
      } else {
        os << "  " << std::right << std::setw(static_cast<int>(width[i])) << rows[r][i];
      }
    }
    os << "\n";
    if (r == 0) {
      std::size_t total = 0;
      for (auto w : width) total += w + 2;
      os << std::string(total > 2 ? total - 2 : 0, '-') << "\n";
    }
  }
  os << std::flush;
}

std::string csv_cell(const std::optional<Json>& value) {
  if (!value || value->is_null()) return "";
  if (!value->is_string()) return value->dump();
  const std::string& text = value->get_ref<const std::string&>();
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char ch : text) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return quoted + "\"";
}

std::string fmt_num(double value, int digits) {
  if (!std::isfinite(value)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, value);
  return buf;
}

std::vector<BackwardMode> mode_list(const std::string& value) {
  if (value == "both") return {BackwardMode::kStandard, BackwardMode::kSplit};
  return {parse_backward_mode(value)};
}

std::vector<std::string> mode_choices() {
  return {to_string(BackwardMode::kStandard), to_string(BackwardMode::kSplit), "both"};
}

std::vector<std::string> name_list(const std::string& value, const std::vector<std::string>& known,
                                   const std::string& what) {
  if (value == "all") return known;
  std::vector<std::string> names;
  std::size_t start = 0;
  while (start <= value.size()) {
    const std::size_t comma = std::min(value.find(',', start), value.size());
    const std::string name = value.substr(start, comma - start);
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw std::invalid_argument("unknown " + what + " '" + name + "': expected all, or one or more " +
                                  "(comma-separated) of " + list);
    }
    names.push_back(name);
    start = comma + 1;
  }
  return names;
}

}  // namespace twobp::bench
