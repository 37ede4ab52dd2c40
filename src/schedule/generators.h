#pragma once
// Private: the built-in generators, for the registry (registry.cpp).

#include <vector>

#include "twobp/schedule/registry.h"

namespace twobp::detail {

/// One entry per built-in schedule, in the order of builtin_schedule_names().
std::vector<ScheduleInfo> builtin_schedules();

}  // namespace twobp::detail
