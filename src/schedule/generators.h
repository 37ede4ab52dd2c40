#pragma once
// Private: the built-in generators, for the registry (registry.cpp).

#include <string_view>
#include <vector>

#include "schedule/controllable_v.h"
#include "twobp/schedule/registry.h"

namespace twobp::detail {

/// One entry per built-in schedule, in the order of builtin_schedule_names().
std::vector<ScheduleInfo> builtin_schedules();

/// The "synth" entry: SynthesizedScheduleGenerator with its defaults (src/schedule/synthesize.cpp, a search over
/// costs), listed here so that it is a built-in like the others (every test that walks builtin_schedule_names()
/// covers it).
ScheduleInfo synthesized_schedule_info();

/// A V schedule (zb-v's placement) from a unit-slot plan: each rank's F's and I's in slot order, W's where
/// v_weight_slots puts them, the W's still pending after the rank's last I as one batched W per stage; the
/// standard form fuses each I with its W into B. v-half and v-min are this of their squeezed blocks; tests compare
/// the blocks themselves.
Schedule v_schedule_from_slots(std::string_view name, const ScheduleOptions& options,
                               const std::vector<VRankSlots>& slots);

}  // namespace twobp::detail
