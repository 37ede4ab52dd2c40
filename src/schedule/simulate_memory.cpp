// Peak tensor memory per rank over one step (see simulate_peak_memory in twobp/schedule/simulate.h).

#include <algorithm>
#include <set>

#include "twobp/error.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "util/check.h"

namespace twobp {

std::vector<double> simulate_peak_memory(const Schedule& schedule, const MemoryModel& model) {
  TWOBP_CHECK(static_cast<int>(model.base.size()) == schedule.num_ranks, UsageError,
              "simulate_peak_memory: MemoryModel::base has {} entries, the schedule has {} ranks", model.base.size(),
              schedule.num_ranks);
  TWOBP_CHECK(static_cast<int>(model.stages.size()) == schedule.num_stages, UsageError,
              "simulate_peak_memory: MemoryModel::stages has {} entries, the schedule has {} stages",
              model.stages.size(), schedule.num_stages);
  TWOBP_CHECK(model.gradients.empty() || static_cast<int>(model.gradients.size()) == schedule.num_stages, UsageError,
              "simulate_peak_memory: MemoryModel::gradients has {} entries, the schedule has {} stages (or give none)",
              model.gradients.size(), schedule.num_stages);
  std::vector<double> peaks(schedule.num_ranks, 0.0);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    double level = model.base[r], peak = level;
    std::set<int> has_gradients;  // stages whose gradients this step allocated already
    for (const Action& a : schedule.actions[r]) {
      const ActionMemory& m = model.stages[a.stage][static_cast<int>(a.type)];
      const double k = a.type == ActionType::kBackwardWeight ? static_cast<double>(a.micro_batches.size()) : 1.0;
      const bool weights = makes_weight_grads(a.type);
      const double gradients =
          weights && !model.gradients.empty() && has_gradients.insert(a.stage).second ? model.gradients[a.stage] : 0.0;
      peak = std::max(peak, level + k * m.rise + gradients);
      level += k * m.added + gradients;
    }
    peaks[r] = peak;
  }
  return peaks;
}

}  // namespace twobp
