// ASCII rendering of a schedule as a rank x time grid.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "schedule/dry_run.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"

namespace twobp {
namespace {

// Unit costs keep the picture readable: one column per F, I and per micro-batch of W; B is I + W, two columns.
CostModel grid_costs(int num_stages) { return CostModel::uniform(num_stages, 1.0, 1.0, 1.0, 0.0); }

bool one_stage_per_rank(const Schedule& sc) {
  if (sc.num_stages != sc.num_ranks) return false;
  for (int s = 0; s < sc.num_stages; ++s) {
    if (sc.stage_to_rank[s] != s) return false;
  }
  return true;
}

}  // namespace

std::string render_grid(const Schedule& schedule, const Action* mark, int mark_rank) {
  detail::check_structure(schedule);
  const detail::DryRun run = detail::dry_run(schedule, grid_costs(schedule.num_stages), /*force=*/true);
  const bool show_stage = !one_stage_per_rank(schedule);

  // Locate the marked action: the first equal action on mark_rank (or on any rank when mark_rank is -1).
  int marked_rank = -1;
  long marked_index = -1;
  if (mark != nullptr) {
    for (int r = 0; r < schedule.num_ranks && marked_rank < 0; ++r) {
      if (mark_rank >= 0 && r != mark_rank) continue;
      const auto& list = schedule.actions[r];
      for (std::size_t i = 0; i < list.size(); ++i) {
        if (list[i] == *mark) {
          marked_rank = r;
          marked_index = static_cast<long>(i);
          break;
        }
      }
    }
  }
  const long marked_event = marked_rank >= 0 ? run.event_index[marked_rank][marked_index] : -1;

  double end_time = 0.0;
  for (const auto& e : run.events) end_time = std::max(end_time, e.end);
  const auto slots = static_cast<std::size_t>(std::ceil(end_time - 1e-9));
  std::vector<std::vector<std::string>> cells(schedule.num_ranks, std::vector<std::string>(slots, ".."));
  std::size_t width = 2;
  for (std::size_t ei = 0; ei < run.events.size(); ++ei) {
    const SimulatedEvent& e = run.events[ei];
    if (!is_compute(e.action.type)) continue;
    const auto first = static_cast<std::size_t>(std::llround(e.start));
    const auto last = static_cast<std::size_t>(std::llround(e.end));
    for (std::size_t t = first; t < last && t < slots; ++t) {
      // A batched W spends one column per micro-batch; show which one.
      const std::size_t j = t - first;
      const int mb = e.action.micro_batches[std::min(j, e.action.micro_batches.size() - 1)];
      std::string label = show_stage ? fmt::format("{}{}.{}", to_string(e.action.type), e.action.stage, mb)
                                     : fmt::format("{}{}", to_string(e.action.type), mb);
      if (static_cast<long>(ei) == marked_event) label = "[" + label + "]";
      width = std::max(width, label.size());
      cells[e.rank][t] = std::move(label);
    }
  }

  std::string out;
  const std::string rank_label_example = fmt::format("rank {}", schedule.num_ranks - 1);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    out += fmt::format("{:<{}} |", fmt::format("rank {}", r), rank_label_example.size());
    for (const std::string& c : cells[r]) out += fmt::format(" {:<{}}", c, width);
    // Trailing padding carries no information.
    while (!out.empty() && out.back() == ' ') out.pop_back();
    out += '\n';
  }
  out += "(one column per unit: F, I and each micro-batch of W take 1, B takes 2; '..' is idle";
  out += show_stage ? "; cells read <action><stage>.<micro-batch>)\n" : "; cells read <action><micro-batch>)\n";
  if (mark != nullptr) {
    if (marked_rank < 0) {
      out += fmt::format("marked action {} does not occur on rank {}\n", describe(*mark), mark_rank);
    } else if (!is_compute(mark->type)) {
      out += fmt::format(
          "marked: rank {}: {} (action #{} of the rank), a communication action at time {:g} (not "
          "drawn)\n",
          marked_rank, describe(*mark), marked_index, run.events[marked_event].start);
    } else {
      out +=
          fmt::format("[..] marks rank {}: {} (action #{} of the rank)\n", marked_rank, describe(*mark), marked_index);
    }
  }
  for (const auto& [r, i] : run.forced) {
    out += fmt::format(
        "rank {} action #{} ({}) never runs: its input never arrives; drawn where the rank reaches "
        "it\n",
        r, i, describe(schedule.actions[r][i]));
  }
  return out;
}

}  // namespace twobp
