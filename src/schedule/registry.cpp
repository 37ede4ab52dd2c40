// The schedule registry: built-ins (generators.cpp) and user registrations, and what --schedule options resolve to.

#include "twobp/schedule/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <mutex>
#include <utility>

#include "schedule/generators.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"
#include "util/check.h"

namespace twobp {
namespace {

// The single list of schedule names and their defaults: built-ins first, then register_schedule() additions.
struct Registry {
  std::mutex mutex;
  std::vector<ScheduleInfo> entries;

  Registry() : entries(detail::builtin_schedules()), builtins(entries.size()) {}
  std::size_t builtins;  // the first entries, in the order of detail::builtin_schedules()
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_schedule(ScheduleInfo info) {
  TWOBP_CHECK(!info.name.empty() && static_cast<bool>(info.make), UsageError,
              "register_schedule: a schedule needs a name and a generator factory");
  TWOBP_CHECK(info.default_chunks_per_rank >= 1, UsageError,
              "register_schedule('{}'): default_chunks_per_rank must be >= 1, got {}", info.name,
              info.default_chunks_per_rank);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& e : r.entries) {
    TWOBP_CHECK(e.name != info.name, UsageError, "register_schedule: a schedule named '{}' is already registered",
                info.name);
  }
  r.entries.push_back(std::move(info));
}

std::vector<std::string> schedule_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& e : r.entries) names.push_back(e.name);
  return names;
}

ScheduleInfo schedule_info(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& e : r.entries) {
    if (e.name == name) return e;
  }
  std::vector<std::string> names;
  for (const auto& e : r.entries) names.push_back(e.name);
  detail::raise<UsageError>("unknown schedule '{}'; known schedules: {} (or load one from its text form with "
                            "load_schedule / --schedule-file)",
                            name, fmt::join(names, ", "));
}

std::vector<std::string> builtin_schedule_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (std::size_t k = 0; k < r.builtins; ++k) names.push_back(r.entries[k].name);
  return names;
}

std::unique_ptr<ScheduleGenerator> make_schedule_generator(std::string_view name) { return schedule_info(name).make(); }

ScheduleOptions default_schedule_options(std::string_view name, int ranks, int micro_batches, BackwardMode backward) {
  ScheduleOptions o;
  o.ranks = ranks;
  o.micro_batches = micro_batches;
  o.chunks_per_rank = schedule_info(name).default_chunks_per_rank;
  o.backward = backward;
  return o;
}

Schedule make_schedule(std::string_view name, const ScheduleOptions& options) {
  Schedule schedule = make_schedule_generator(name)->generate(options);
  validate(schedule);
  return schedule;
}

Schedule resolve_schedule(const ScheduleChoice& choice, int ranks, int micro_batches, BackwardMode backward) {
  if (choice.file.empty()) {
    ScheduleOptions o = default_schedule_options(choice.name, ranks, micro_batches, backward);
    if (choice.chunks_per_rank > 0) o.chunks_per_rank = choice.chunks_per_rank;
    return make_schedule(choice.name, o);
  }
  Schedule schedule = load_schedule_file(choice.file);
  validate(schedule);
  TWOBP_CHECK(schedule.num_ranks == ranks, UsageError,
              "schedule file '{}' is for {} ranks, but the program runs {} ranks", choice.file, schedule.num_ranks,
              ranks);
  TWOBP_CHECK(schedule.num_micro_batches == micro_batches, UsageError,
              "schedule file '{}' has {} micro-batches, but the program was asked for {} (--microbatches)",
              choice.file, schedule.num_micro_batches, micro_batches);
  return schedule;
}

}  // namespace twobp
