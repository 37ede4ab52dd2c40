#pragma once
// Helpers shared by the twobp_bench subcommands: wall-clock timing, robust statistics over repetitions, JSON
// output (nlohmann/json) with a read-back check, and a plain-text table. No torch here (keeps this TU cheap).

#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "twobp/metrics/metrics.h"   // Summary, Series (no torch)
#include "twobp/schedule/schedule.h"  // BackwardMode (no torch)

namespace twobp::bench {

using Json = nlohmann::ordered_json;  // keeps keys in insertion order: readable files

using metrics::Series;
using metrics::Summary;
using metrics::summarize;
/// {"min":..,"p25":..,"median":..,"p75":..,"max":..,"n":..}
Json to_json(const Summary& s);
/// {"<name>": to_json(summarize(samples))...} for every series.
Json spread(const Series& series);

Json read_json(const std::string& path);

/// Checks that every `paths` entry ("a/b/c" = json["a"]["b"]["c"]) exists in `json` and is a finite number
/// (> 0 when `positive`). Returns one message per violation; empty means valid.
std::vector<std::string> check_numbers(const Json& json, const std::vector<std::string>& paths, bool positive);

/// A fixed-width text table: the first row is the header.
void print_table(std::ostream& os, const std::vector<std::vector<std::string>>& rows);
/// `value` with `digits` decimals.
std::string fmt_num(double value, int digits = 2);

/// One output of a benchmark's result rows. The JSON results, the table and the CSV are all written from one list
/// of these (Reporter), so that a new output is one Column and its place in the table.
template <typename Row>
struct Column {
  std::string key;  ///< the JSON key, and the CSV header
  /// The row's value; nullopt: this row has none (its JSON leaves the key out, its CSV cell is empty).
  std::function<std::optional<Json>(const Row&)> value;
  std::string header = {};                           ///< the table's header; empty: not in the table
  std::function<std::string(const Row&)> text = {};  ///< the table cell (needed when `header` is set)
  bool csv = true;  ///< false for structured values (objects, lists), which have no CSV cell
};

/// A column whose value every row has; `text` (with `header`) its table cell.
template <typename Row>
Column<Row> column(std::string key, std::function<Json(const Row&)> value, std::string header = {},
                   std::function<std::string(const Row&)> text = {}, bool csv = true) {
  return {std::move(key), [value](const Row& r) -> std::optional<Json> { return value(r); }, std::move(header),
          std::move(text), csv};
}

/// A column whose value only the rows where `when` holds have.
template <typename Row>
Column<Row> column_if(std::string key, std::function<bool(const Row&)> when, std::function<Json(const Row&)> value,
                      std::string header = {}, std::function<std::string(const Row&)> text = {}, bool csv = true) {
  return {std::move(key),
          [when, value](const Row& r) -> std::optional<Json> {
            return when(r) ? std::optional<Json>(value(r)) : std::nullopt;
          },
          std::move(header), std::move(text), csv};
}

/// A table-only column: `header` and its cell, no JSON value (for tables whose lines are no results, e.g. two
/// results side by side).
template <typename Row>
Column<Row> cell(std::string header, std::function<std::string(const Row&)> text) {
  return {header, [](const Row&) { return std::optional<Json>(); }, header, std::move(text), false};
}

/// A CSV cell: empty for no value or null, a string as it is (quoted when it holds a comma or a quote), else its
/// JSON text (numbers round-trip, booleans true/false).
std::string csv_cell(const std::optional<Json>& value);

/// Writes rows through a list of columns: JSON objects in the columns' order, the table in `table` order (headers
/// of columns), the CSV in the columns' order (those with `csv`).
template <typename Row>
class Reporter {
 public:
  Reporter(std::vector<Column<Row>> columns, const std::vector<std::string>& table) : columns_(std::move(columns)) {
    for (const std::string& header : table) {
      std::size_t k = 0;
      while (k < columns_.size() && columns_[k].header != header) ++k;
      if (k == columns_.size() || !columns_[k].text) {
        throw std::logic_error("Reporter: table header '" + header + "' names no column with a text cell");
      }
      table_.push_back(k);
    }
  }

  /// A table of `columns` in their order (every one with a header and a text cell).
  explicit Reporter(std::vector<Column<Row>> columns) : columns_(std::move(columns)) {
    for (std::size_t k = 0; k < columns_.size(); ++k) table_.push_back(k);
  }

  Json json(const Row& row) const {
    Json j = Json::object();
    for (const Column<Row>& c : columns_) {
      if (std::optional<Json> v = c.value(row)) j[c.key] = std::move(*v);
    }
    return j;
  }

  /// The header row, then one row per result (print_table's input).
  std::vector<std::vector<std::string>> table(const std::vector<Row>& rows) const {
    std::vector<std::vector<std::string>> out(1);
    for (std::size_t k : table_) out[0].push_back(columns_[k].header);
    for (const Row& row : rows) {
      out.emplace_back();
      for (std::size_t k : table_) out.back().push_back(columns_[k].text(row));
    }
    return out;
  }

  std::string csv(const std::vector<Row>& rows) const {
    std::string out;
    auto line = [&](auto&& cell) {
      bool first = true;
      for (const Column<Row>& c : columns_) {
        if (!c.csv) continue;
        if (!first) out += ',';
        out += cell(c);
        first = false;
      }
      out += '\n';
    };
    line([](const Column<Row>& c) { return c.key; });
    for (const Row& row : rows) line([&](const Column<Row>& c) { return csv_cell(c.value(row)); });
    return out;
  }

 private:
  std::vector<Column<Row>> columns_;
  std::vector<std::size_t> table_;  // indices into columns_, in table order
};

/// A --mode value: "both" (standard, then 2bp), or one mode as parse_backward_mode() reads it. Every output names
/// a mode by to_string(BackwardMode).
std::vector<BackwardMode> mode_list(const std::string& value);
/// What --mode offers: each mode's to_string() and "both".
std::vector<std::string> mode_choices();

/// A command-line list of names: "all" (every `known` name) or names of `known` separated by commas, in the given
/// order. Throws std::invalid_argument naming the unknown one, `what` it should be ("schedule") and the known ones.
std::vector<std::string> name_list(const std::string& value, const std::vector<std::string>& known,
                                   const std::string& what);

}  // namespace twobp::bench
