// The schedule registry (the single source of names and defaults) and resolve_schedule (what every CLI's
// --schedule / --schedule-file / --chunks-per-rank options mean).

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "common/expect_error.h"
#include "common/temp_files.h"
#include "twobp/error.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/text.h"

namespace twobp::testing {
namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

TEST(ScheduleRegistry, BuiltinsComeFirstWithTheirDefaults) {
  const auto names = schedule_names();
  const auto builtins = builtin_schedule_names();
  ASSERT_GE(names.size(), builtins.size());
  EXPECT_TRUE(std::equal(builtins.begin(), builtins.end(), names.begin()));
  for (const auto& name : builtins) {
    const int v = schedule_info(name).default_chunks_per_rank;
    const bool one_chunk = name == "gpipe" || name == "1f1b" || name == "zb-h1" || name == "zb-h2";
    EXPECT_EQ(v, one_chunk ? 1 : 2) << name;
    EXPECT_EQ(default_schedule_options(name, 3, 6, BackwardMode::kSplit).chunks_per_rank, v) << name;
    EXPECT_FALSE(schedule_info(name).summary.empty()) << name;
  }
}

// A user schedule: 1F1B under another name, with two chunks per rank by default (interleaved placement).
class RenamedInterleaved : public ScheduleGenerator {
 public:
  std::string name() const override { return "my-interleaved"; }
  Schedule generate(const ScheduleOptions& options) const override {
    Schedule s = make_schedule_generator("interleaved-1f1b")->generate(options);
    s.name = name();
    return s;
  }
};

TEST(ScheduleRegistry, UserSchedulesWorkWhereverBuiltinsDo) {
  if (!contains(schedule_names(), "my-interleaved")) {
    register_schedule({"my-interleaved", [] { return std::make_unique<RenamedInterleaved>(); }, 2, "a test schedule"});
  }
  EXPECT_TRUE(contains(schedule_names(), "my-interleaved"));
  const Schedule s = resolve_schedule({"my-interleaved", "", 0}, 2, 4, BackwardMode::kSplit);
  EXPECT_EQ(s.name, "my-interleaved");
  EXPECT_EQ(s.num_stages, 4) << "the registered default of 2 chunks per rank applies";
  EXPECT_EQ(resolve_schedule({"my-interleaved", "", 3}, 2, 4, BackwardMode::kSplit).num_stages, 6);
  expect_error<UsageError>(
      [] { register_schedule({"my-interleaved", [] { return std::make_unique<RenamedInterleaved>(); }, 2, ""}); },
      {"'my-interleaved'", "already registered"});
  expect_error<UsageError>([] { register_schedule({"", nullptr, 1, ""}); }, {"name"});
}

TEST(ScheduleRegistry, UnknownNameListsTheKnownOnes) {
  expect_error<UsageError>([] { make_schedule_generator("2f2b"); },
                           {"unknown schedule '2f2b'", "1f1b", "zb-v", "--schedule-file"});
}

TEST(ResolveSchedule, FileWinsAndMustFitTheRun) {
  const std::string dir = make_temp_dir("registry_test");
  const std::string path = dir + "/zbh1.txt";
  const Schedule original = make_schedule("zb-h1", default_schedule_options("zb-h1", 2, 4, BackwardMode::kSplit));
  std::ofstream(path) << dump_schedule(original);

  // The file's schedule and mode are used, whatever the name and mode arguments say.
  const Schedule loaded = resolve_schedule({"gpipe", path, 0}, 2, 4, BackwardMode::kStandard);
  EXPECT_EQ(dump_schedule(loaded), dump_schedule(original));
  EXPECT_EQ(loaded.backward, BackwardMode::kSplit);

  expect_error<UsageError>([&] { resolve_schedule({"1f1b", path, 0}, 3, 4, BackwardMode::kSplit); },
                           {path, "2 ranks", "runs 3 ranks"});
  expect_error<UsageError>([&] { resolve_schedule({"1f1b", path, 0}, 2, 8, BackwardMode::kSplit); },
                           {path, "4 micro-batches", "asked for 8"});
  expect_error<IOError>([&] { resolve_schedule({"1f1b", dir + "/missing.txt", 0}, 2, 4, BackwardMode::kSplit); },
                        {"missing.txt"});
  std::ofstream(dir + "/bad.txt") << "not a schedule\n";
  expect_error<ScheduleError>([&] { resolve_schedule({"1f1b", dir + "/bad.txt", 0}, 2, 4, BackwardMode::kSplit); },
                              {"bad.txt"});
  remove_tree(dir);
}

}  // namespace
}  // namespace twobp::testing
