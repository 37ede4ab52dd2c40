#include "twobp/trace/attribution.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <utility>

#include "trace/palette.h"
#include "twobp/error.h"
#include "twobp/schedule/messages.h"
#include "util/check.h"
#include "util/xml.h"

namespace twobp {

const char* to_string(StepPart part) {
  switch (part) {
    case StepPart::kForward: return "F";
    case StepPart::kBackwardInput: return "I";
    case StepPart::kBackwardWeight: return "W";
    case StepPart::kBackward: return "B";
    case StepPart::kRecompute: return "recompute";
    case StepPart::kOverlappedPair: return "F&B pair";
    case StepPart::kSend: return "send";
    case StepPart::kWaitActivation: return "wait F";
    case StepPart::kWaitGradient: return "wait B";
    case StepPart::kBetweenActions: return "between";
    case StepPart::kFinish: return "finish";
    case StepPart::kReduceWait: return "dp reduce";
    case StepPart::kPipelineOther: return "pipeline";
    case StepPart::kOptimizer: return "optimizer";
    case StepPart::kIdleEnd: return "idle end";
  }
  return "?";
}

double StepAttribution::parts_sum_us() const { return std::accumulate(parts_us.begin(), parts_us.end(), 0.0); }

StepAttribution attribute_step(const Schedule& schedule, const Trace& trace, const StepTimes& times) {
  StepAttribution a;
  a.rank = trace.events.empty() ? 0 : trace.events.front().rank;
  double cursor = 0.0;  // end of the last event placed, on the trace's clock (0 = the executor's step start)
  const auto& events = trace.events;
  for (std::size_t k = 0; k < events.size(); ++k) {
    const TraceEvent& e = events[k];
    a[StepPart::kBetweenActions] += std::max(0.0, e.start_us - cursor);
    const double span = e.end_us - e.start_us;
    cursor = std::max(cursor, e.end_us);
    // An overlapped pair is recorded as two events over the same span (Executor::execute_pair): count it once.
    if (ran_as_pair(events, k)) {
      a[StepPart::kOverlappedPair] += span;
      ++k;
      continue;
    }
    switch (e.action.type) {
      case ActionType::kForward: a[StepPart::kForward] += span; break;
      case ActionType::kBackwardWeight: a[StepPart::kBackwardWeight] += span; break;
      case ActionType::kBackwardInput:
      case ActionType::kBackward: {
        const double recompute = std::min(e.recompute_us, span);
        a[StepPart::kRecompute] += recompute;
        a[e.action.type == ActionType::kBackward ? StepPart::kBackward : StepPart::kBackwardInput] += span - recompute;
        break;
      }
      case ActionType::kSendForward:
      case ActionType::kSendBackward: a[StepPart::kSend] += span; break;
      case ActionType::kRecvForward:
      case ActionType::kRecvBackward: {
        const bool gradient = e.action.type == ActionType::kRecvBackward;
        int peer = -1;
        try {
          peer = peer_rank(schedule, e.action);
        } catch (const ScheduleError& error) {
          detail::raise<UsageError>("attribute_step: rank {}'s trace does not belong to schedule '{}': {}", a.rank,
                                    schedule.name, error.what());
        }
        a[gradient ? StepPart::kWaitGradient : StepPart::kWaitActivation] += span;
        a.waits_by_peer_us[peer][gradient ? 1 : 0] += span;
        break;
      }
    }
  }
  a[StepPart::kFinish] = std::max(0.0, trace.step_us - cursor);
  const double pipeline_us = times.pipeline_us >= 0.0 ? times.pipeline_us : trace.step_us;
  a[StepPart::kReduceWait] = times.reduce_wait_us;
  a[StepPart::kPipelineOther] = std::max(0.0, pipeline_us - trace.step_us - times.reduce_wait_us);
  a[StepPart::kOptimizer] = times.optimizer_us;
  a.step_us = times.step_us >= 0.0 ? times.step_us : pipeline_us + times.optimizer_us;
  a[StepPart::kIdleEnd] = std::max(0.0, a.step_us - pipeline_us - times.optimizer_us);
  return a;
}

StepAttribution mean_attribution(const std::vector<StepAttribution>& steps) {
  TWOBP_CHECK(!steps.empty(), UsageError, "mean_attribution: no steps");
  StepAttribution mean;
  mean.rank = steps.front().rank;
  const auto n = static_cast<double>(steps.size());
  for (const StepAttribution& s : steps) {
    TWOBP_CHECK(s.rank == mean.rank, UsageError, "mean_attribution: steps of rank {} and rank {} mixed", mean.rank,
                s.rank);
    mean.step_us += s.step_us / n;
    for (int p = 0; p < kNumStepParts; ++p) mean.parts_us[p] += s.parts_us[p] / n;
    for (const auto& [peer, w] : s.waits_by_peer_us) {
      mean.waits_by_peer_us[peer][0] += w[0] / n;
      mean.waits_by_peer_us[peer][1] += w[1] / n;
    }
  }
  return mean;
}

std::vector<StepAttribution> gather_attributions(Transport& transport, const StepAttribution& mine,
                                                 Duration timeout) {
  const int world = transport.world_size(), rank = transport.rank();
  // Row r: step_us, the parts, then {activations, gradients} waited for from each rank of the transport.
  const int64_t width = 1 + kNumStepParts + 2 * static_cast<int64_t>(world);
  at::Tensor rows = at::zeros({world, width}, at::kDouble);
  double* row = rows[rank].data_ptr<double>();
  row[0] = mine.step_us;
  std::copy(mine.parts_us.begin(), mine.parts_us.end(), row + 1);
  for (const auto& [peer, w] : mine.waits_by_peer_us) {
    TWOBP_CHECK(peer >= 0 && peer < world, UsageError,
                "gather_attributions: rank {} waited for rank {}, which the transport (world size {}) does not have",
                rank, peer, world);
    row[1 + kNumStepParts + 2 * peer] = w[0];
    row[1 + kNumStepParts + 2 * peer + 1] = w[1];
  }
  at::Tensor all = rows.to(transport.device());
  transport.all_reduce_sum(all, timeout);
  const at::Tensor host = all.cpu().contiguous();
  std::vector<StepAttribution> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    const double* v = host[r].data_ptr<double>();
    StepAttribution& a = out[static_cast<std::size_t>(r)];
    a.rank = r;
    a.step_us = v[0];
    std::copy(v + 1, v + 1 + kNumStepParts, a.parts_us.begin());
    for (int peer = 0; peer < world; ++peer) {
      const double f = v[1 + kNumStepParts + 2 * peer], b = v[1 + kNumStepParts + 2 * peer + 1];
      if (f != 0.0 || b != 0.0) a.waits_by_peer_us[peer] = {f, b};
    }
  }
  return out;
}

std::string format_attribution(const StepAttribution& a) {
  std::string line = fmt::format("rank {}: step {:.2f} ms:", a.rank, a.step_us / 1000.0);
  const double step = a.step_us > 0.0 ? a.step_us : 1.0;
  for (int p = 0; p < kNumStepParts; ++p) {
    if (a.parts_us[p] < 0.005 * step) continue;  // what would print as 0 %
    line += fmt::format(" {} {:.0f}%", to_string(static_cast<StepPart>(p)), 100.0 * a.parts_us[p] / step);
  }
  int worst = -1;
  double worst_us = 0.0;
  for (const auto& [peer, w] : a.waits_by_peer_us) {
    if (w[0] + w[1] > worst_us) worst = peer, worst_us = w[0] + w[1];
  }
  if (worst >= 0) line += fmt::format("; longest wait: for rank {} ({:.0f}%)", worst, 100.0 * worst_us / step);
  return line;
}

std::string to_attribution_json(const std::vector<StepAttribution>& ranks) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const StepAttribution& a : ranks) {
    nlohmann::ordered_json parts = nlohmann::ordered_json::object();
    for (int p = 0; p < kNumStepParts; ++p) parts[to_string(static_cast<StepPart>(p))] = a.parts_us[p] / 1000.0;
    nlohmann::ordered_json waits = nlohmann::ordered_json::object();
    for (const auto& [peer, w] : a.waits_by_peer_us) {
      waits[std::to_string(peer)] = {{"F", w[0] / 1000.0}, {"B", w[1] / 1000.0}};
    }
    out.push_back({{"rank", a.rank},
                   {"step_ms", a.step_us / 1000.0},
                   {"parts_ms", parts},
                   {"wait_ms_by_peer", waits},
                   {"unaccounted_ms", (a.step_us - a.parts_sum_us()) / 1000.0}});
  }
  return out.dump();
}

namespace {

// One colour per part: the action parts in the timeline's colours, the rest in greys and muted hues.
const char* part_colour(StepPart p) {
  switch (p) {
    case StepPart::kForward: return detail::action_colour(ActionType::kForward);
    case StepPart::kBackwardInput: return detail::action_colour(ActionType::kBackwardInput);
    case StepPart::kBackwardWeight: return detail::action_colour(ActionType::kBackwardWeight);
    case StepPart::kBackward: return detail::action_colour(ActionType::kBackward);
    case StepPart::kRecompute: return "#b07aa1";
    case StepPart::kOverlappedPair: return "#9c755f";
    case StepPart::kSend: return "#76b7b2";
    case StepPart::kWaitActivation: return "#edc948";
    case StepPart::kWaitGradient: return "#ff9da7";
    case StepPart::kBetweenActions: return "#bab0ac";
    case StepPart::kFinish: return "#8c8c8c";
    case StepPart::kReduceWait: return "#499894";
    case StepPart::kPipelineOther: return "#d4a6c8";
    case StepPart::kOptimizer: return "#86bcb6";
    case StepPart::kIdleEnd: return "#e8e8e8";
  }
  return "#000000";
}

}  // namespace

std::string to_attribution_svg(const std::vector<StepAttribution>& ranks, const std::string& title) {
  const double width = 1000.0, row = 30.0, left = 70.0, top = 40.0, axis = 34.0;
  double longest = 1.0;
  for (const auto& a : ranks) longest = std::max({longest, a.step_us, a.parts_sum_us()});
  const double scale = (width - left - 20.0) / longest;
  const double rows_end = top + row * static_cast<double>(ranks.size());
  std::array<bool, kNumStepParts> used{};
  std::string svg;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const StepAttribution& a = ranks[r];
    const double y = top + row * static_cast<double>(r);
    svg += fmt::format("<text x=\"8\" y=\"{:.1f}\">rank {}</text>\n", y + row / 2 + 4, a.rank);
    double x = left;
    for (int p = 0; p < kNumStepParts; ++p) {
      const double us = a.parts_us[p];
      if (us <= 0.0) continue;
      used[p] = true;
      const auto part = static_cast<StepPart>(p);
      std::string tip = fmt::format("{}: {:.2f} ms ({:.1f}%)", to_string(part), us / 1000.0,
                                    100.0 * us / std::max(1e-9, a.step_us));
      if (part == StepPart::kWaitActivation || part == StepPart::kWaitGradient) {
        const int kind = part == StepPart::kWaitGradient ? 1 : 0;
        for (const auto& [peer, w] : a.waits_by_peer_us) {
          if (w[kind] > 0.0) tip += fmt::format("; from rank {} {:.2f} ms", peer, w[kind] / 1000.0);
        }
      }
      svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                         "stroke=\"white\" stroke-width=\"0.5\"><title>{}</title></rect>\n",
                         x, y + 3, us * scale, row - 6, part_colour(part), detail::xml_escaped(tip));
      x += us * scale;
    }
  }
  svg += detail::time_axis_ms(left, rows_end, longest, scale);
  // Legend: the parts that occur, in order, wrapped at the picture's width.
  double lx = left, ly = rows_end + axis + 16;
  for (int p = 0; p < kNumStepParts; ++p) {
    if (!used[p]) continue;
    const std::string name = to_string(static_cast<StepPart>(p));
    const double w = 26.0 + 7.0 * static_cast<double>(name.size());
    if (lx + w > width) lx = left, ly += 18;
    svg += fmt::format("<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.0f}\" "
                       "y=\"{:.0f}\">{}</text>\n",
                       lx, ly - 10, part_colour(static_cast<StepPart>(p)), lx + 16, ly,
                       detail::xml_escaped(name));
    lx += w;
  }
  const double height = ly + 14;
  return fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
                     "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" "
                     "fill=\"white\"/>\n<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
                     width, height, left, detail::xml_escaped(title)) +
         svg + "</svg>\n";
}

}  // namespace twobp
