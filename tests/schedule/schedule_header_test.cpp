// Code written against twobp/schedule/schedule.h before it was split by concern (registry, messages, text,
// validate, simulate) includes only it and must keep compiling: the header still declares all of that (at its
// end). This file includes nothing else of twobp on purpose.
#include <gtest/gtest.h>

#include "twobp/schedule/schedule.h"

namespace twobp {
namespace {

TEST(ScheduleHeader, DeclaresWhatItDidBeforeTheSplit) {
  const Schedule schedule = make_schedule("1f1b", {/*ranks=*/2, /*micro_batches=*/4, /*chunks_per_rank=*/1,
                                                   BackwardMode::kSplit});              // registry.h
  validate(schedule);                                                                     // validate.h
  const Schedule reloaded = load_schedule(dump_schedule(schedule));                      // text.h
  EXPECT_EQ(dump_schedule(reloaded), dump_schedule(schedule));
  const SimulationResult result = simulate(schedule, CostModel::uniform(2, 1.0, 1.0, 1.0));  // simulate.h
  EXPECT_GT(result.step_time, 0.0);
  EXPECT_GT(message_tag_span(schedule), 0);                                              // messages.h
  EXPECT_FALSE(schedule_names().empty());                                                // registry.h
}

}  // namespace
}  // namespace twobp
