#pragma once
// Text forms of a schedule: twobp's own (one action per line, round-trips exactly) and an ASCII picture. PyTorch's
// CSV form is in pytorch_csv.h.

#include <string>
#include <string_view>

#include "twobp/schedule/schedule.h"

namespace twobp {

/// Text form: a header line, then one action per line. dump() and load() round-trip exactly.
std::string dump_schedule(const Schedule& schedule);
/// Parses the text form; throws ScheduleError naming the line number and what was expected.
Schedule load_schedule(std::string_view text);
/// load_schedule() of a file's contents -- or, for a name ending in ".csv", from_pytorch_csv()
/// (twobp/schedule/pytorch_csv.h); IOError when it cannot be read, ScheduleError naming the file otherwise.
Schedule load_schedule_file(const std::string& path);
/// Writes `schedule` to `path` in the form load_schedule_file() reads back from that name: PyTorch's CSV for a
/// name ending in ".csv" (to_pytorch_csv), else the text form. IOError naming the file when it cannot be written.
void save_schedule_file(const std::string& path, const Schedule& schedule);

/// ASCII picture: one row per rank, one column per time slot of a unit-cost simulation. `mark`, if given,
/// is highlighted (used to point at the offending action of an invalid schedule).
std::string render_grid(const Schedule& schedule, const Action* mark = nullptr, int mark_rank = -1);

}  // namespace twobp
