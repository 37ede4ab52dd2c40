// Fuzz target: the schedule text form (load_schedule), and what a loaded schedule is fed to next.

#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <typeinfo>

#include "fuzz_targets.h"
#include "twobp/error.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"

namespace twobp::fuzz {
namespace {

std::string differences(const Schedule& a, const Schedule& b) {
  std::string out;
  if (a.name != b.name) out += " name";
  if (a.num_ranks != b.num_ranks) out += " num_ranks";
  if (a.num_stages != b.num_stages) out += " num_stages";
  if (a.num_micro_batches != b.num_micro_batches) out += " num_micro_batches";
  if (a.backward != b.backward) out += " backward";
  if (a.stage_to_rank != b.stage_to_rank) out += " stage_to_rank";
  if (a.actions != b.actions) out += " actions";
  return out;
}

template <typename F>
bool allowed_errors_only(const char* what, F&& f) {
  try {
    f();
    return true;
  } catch (const UsageError&) {  // ScheduleError derives from it
    return false;
  } catch (const std::bad_alloc&) {
    // fuzz.sh caps ASan's allocations (max_allocation_size_mb), so a header that makes the parser or the
    // validator allocate tables of absurd size surfaces here (regress-oom-*.txt were such inputs).
    finding(std::string(what) + " threw std::bad_alloc");
  } catch (const std::exception& e) {
    finding(std::string(what) + " threw " + typeid(e).name() + ": " + e.what());
  } catch (...) {
    finding(std::string(what) + " threw a non-std exception");
  }
}

}  // namespace

int schedule_text(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Schedule schedule;
  if (!allowed_errors_only("load_schedule", [&] { schedule = load_schedule(text); })) return 0;

  // Whatever load_schedule accepts, dump_schedule must write and load_schedule read back unchanged.
  std::string dumped;
  Schedule reloaded;
  try {
    dumped = dump_schedule(schedule);
    reloaded = load_schedule(dumped);
  } catch (const std::exception& e) {
    finding(std::string("round trip of a loaded schedule threw ") + typeid(e).name() + ": " + e.what());
  }
  const std::string diff = differences(schedule, reloaded);
  if (!diff.empty()) finding("dump_schedule -> load_schedule changed:" + diff + "\n--- dumped:\n" + dumped);
  if (dump_schedule(reloaded) != dumped) finding("dump_schedule is not stable across a round trip");

  // validate() must reject bad schedules with ScheduleError (never crash, hang or throw anything else), and a
  // schedule it accepts must be safe to simulate and draw.
  if (!allowed_errors_only("validate", [&] { validate(schedule); })) return 0;
  allowed_errors_only("simulate/render_grid", [&] {
    const SimulationResult result =
        simulate(schedule, CostModel::uniform(schedule.num_stages, 1.0, 1.0, 1.0, 0.5));
    if (!(result.step_time >= 0.0)) finding("simulate of a valid schedule gave a negative or NaN step time");
    (void)render_grid(schedule);
  });
  return 0;
}

}  // namespace twobp::fuzz
