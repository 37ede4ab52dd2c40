// PyTorch's compute_only schedule CSV (see twobp/schedule/pytorch_csv.h).

#include "twobp/schedule/pytorch_csv.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <optional>
#include <vector>

#include "schedule/weight_runs.h"
#include "util/check.h"
#include "util/format.h"

namespace twobp {
namespace {

constexpr std::string_view kOverlapSuffix = "OVERLAP_F_B";

char letter(ActionType t) {
  switch (t) {
    case ActionType::kForward: return 'F';
    case ActionType::kBackwardInput: return 'I';
    case ActionType::kBackwardWeight: return 'W';
    case ActionType::kBackward: return 'B';
    default: return '?';
  }
}

std::string_view trim_cell(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r\"");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r\"");
  return s.substr(first, last - first + 1);
}

std::optional<int> number(std::string_view s) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || value < 0) return std::nullopt;
  return value;
}

// One "<stage><F|I|W|B><micro-batch>" cell, or nullopt when it is not of that form.
std::optional<Action> simple(std::string_view cell) {
  const auto type_at = cell.find_first_not_of("0123456789");
  if (type_at == std::string_view::npos || type_at == 0 || type_at + 1 >= cell.size()) return std::nullopt;
  const auto stage = number(cell.substr(0, type_at));
  const auto mb = number(cell.substr(type_at + 1));
  if (!stage || !mb) return std::nullopt;
  switch (cell[type_at]) {
    case 'F': return Action{ActionType::kForward, *stage, {*mb}};
    case 'I': return Action{ActionType::kBackwardInput, *stage, {*mb}};
    case 'W': return Action{ActionType::kBackwardWeight, *stage, {*mb}};
    case 'B': return Action{ActionType::kBackward, *stage, {*mb}};
    default: return std::nullopt;
  }
}

}  // namespace

std::string to_pytorch_csv(const Schedule& schedule) {
  std::string out;
  for (const auto& actions : schedule.actions) {
    std::vector<std::string> cells;
    bool open_pair = false;          // the previous compute action opened an overlapped pair
    const Action* previous = nullptr;  // the previous compute action
    for (const Action& a : actions) {
      if (!is_compute(a.type)) continue;
      // Two W's of one stage back to back: an empty cell between them (an idle slot to PyTorch), so that the
      // reader keeps them apart instead of joining them into one batched W (see the header).
      if (a.type == ActionType::kBackwardWeight && previous != nullptr &&
          previous->type == ActionType::kBackwardWeight && previous->stage == a.stage) {
        cells.emplace_back();
      }
      previous = &a;
      for (int mb : a.micro_batches) {
        const std::string cell = fmt::format("{}{}{}", a.stage, letter(a.type), mb);
        if (open_pair) {
          cells.back() = fmt::format("({};{}){}", cells.back(), cell, kOverlapSuffix);
        } else {
          cells.push_back(cell);
        }
      }
      open_pair = a.overlapped_with_next;
    }
    out += fmt::format("{}\n", fmt::join(cells, ","));
  }
  return out;
}

Schedule from_pytorch_csv(std::string_view csv, const PytorchCsvOptions& options) {
  csv = detail::without_utf8_bom(csv);
  Schedule s;
  s.name = options.name;
  std::map<int, int> owner;  // stage -> rank
  int max_mb = -1;
  bool split = false;
  std::size_t begin = 0;
  int rank = 0;
  while (begin < csv.size()) {
    auto end = csv.find('\n', begin);
    if (end == std::string_view::npos) end = csv.size();
    const std::string_view line = csv.substr(begin, end - begin);
    begin = end + 1;
    if (trim_cell(line).empty() && begin >= csv.size()) break;  // the file's last newline
    std::vector<Action> actions;
    std::size_t cell_begin = 0;
    int column = 0;
    bool after_gap = false;  // an empty cell since the last action: a W there starts a W of its own
    auto add = [&](Action a, std::string_view cell) {
      const auto [it, fresh] = owner.emplace(a.stage, rank);
      TWOBP_CHECK(it->second == rank, ScheduleError,
                  "PyTorch CSV row {} (rank {}), cell {} '{}': stage {} is already in the row of rank {}; every "
                  "stage runs on one rank",
                  rank + 1, rank, column + 1, cell, a.stage, it->second);
      max_mb = std::max(max_mb, a.micro_batches[0]);
      split = split || a.type == ActionType::kBackwardInput || a.type == ActionType::kBackwardWeight;
      if (options.merge_weight_runs && !after_gap) {
        detail::append_joining_weight_runs(actions, std::move(a));
      } else {
        actions.push_back(std::move(a));
      }
      after_gap = false;
    };
    while (cell_begin <= line.size()) {
      auto cell_end = line.find(',', cell_begin);
      if (cell_end == std::string_view::npos) cell_end = line.size();
      const std::string_view cell = trim_cell(line.substr(cell_begin, cell_end - cell_begin));
      cell_begin = cell_end + 1;
      after_gap = after_gap || cell.empty();
      if (!cell.empty()) {
        if (cell.front() == '(' && cell.size() > kOverlapSuffix.size() + 2 &&
            cell.substr(cell.size() - kOverlapSuffix.size()) == kOverlapSuffix &&
            cell[cell.size() - kOverlapSuffix.size() - 1] == ')') {
          // An overlapped F and B: their parts, in order; an F followed by the B or I of another stage becomes a
          // twobp overlapped pair (Action::overlapped_with_next), anything else plain actions in that order.
          const std::string_view inner = cell.substr(1, cell.size() - kOverlapSuffix.size() - 2);
          std::vector<Action> parts;
          std::size_t p = 0;
          while (p <= inner.size()) {
            auto q = inner.find(';', p);
            if (q == std::string_view::npos) q = inner.size();
            const std::string_view part = trim_cell(inner.substr(p, q - p));
            p = q + 1;
            const auto a = simple(part);
            TWOBP_CHECK(a.has_value(), ScheduleError,
                        "PyTorch CSV row {} (rank {}), cell {} '{}': '{}' is not '<stage><F|I|W|B><micro-batch>'",
                        rank + 1, rank, column + 1, cell, part);
            parts.push_back(*a);
          }
          if (parts.size() == 2 && parts[0].type == ActionType::kForward &&
              (parts[1].type == ActionType::kBackward || parts[1].type == ActionType::kBackwardInput) &&
              parts[0].stage != parts[1].stage) {
            parts[0].overlapped_with_next = true;
          }
          for (Action& a : parts) add(std::move(a), cell);
        } else {
          const auto a = simple(cell);
          TWOBP_CHECK(a.has_value(), ScheduleError,
                      "PyTorch CSV row {} (rank {}), cell {} '{}': expected a compute action "
                      "'<stage><F|I|W|B><micro-batch>' (e.g. 2F0) or an empty cell; communication and resharding "
                      "actions (SEND_F, UNSHARD, ...) belong to the compute_comms form: dump the compute_only one",
                      rank + 1, rank, column + 1, cell);
          add(*a, cell);
        }
      }
      ++column;
      if (cell_end == line.size()) break;
    }
    s.actions.push_back(std::move(actions));
    ++rank;
  }
  TWOBP_CHECK(!owner.empty(), ScheduleError, "PyTorch CSV: no action in {} row(s)", rank);
  s.num_ranks = rank;
  s.num_stages = owner.rbegin()->first + 1;
  s.num_micro_batches = max_mb + 1;
  s.backward = split ? BackwardMode::kSplit : BackwardMode::kStandard;
  for (int stage = 0; stage < s.num_stages; ++stage) {
    const auto it = owner.find(stage);
    TWOBP_CHECK(it != owner.end(), ScheduleError,
                "PyTorch CSV: stage {} appears in no row, but stage {} does (stages are numbered from 0 without gaps)",
                stage, s.num_stages - 1);
    s.stage_to_rank.push_back(it->second);
  }
  return add_communication(std::move(s));
}

}  // namespace twobp
