#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "twobp/error.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"

namespace twobp {
namespace {

TEST(Text, DumpFormat) {
  const Schedule sc = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  const std::string text = dump_schedule(sc);
  EXPECT_EQ(text.substr(0, text.find('\n')),
            "twobp-schedule v1 name=1f1b ranks=2 stages=2 microbatches=2 backward=2bp placement=0,1");
  EXPECT_NE(text.find("\nrank 0: F 0 0\nrank 0: SEND_F 0 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nrank 1: W 1 0,1\n"), std::string::npos) << text;
}

// A file saved by a spreadsheet or an editor that writes a UTF-8 byte order mark reads as without one, in both
// forms (the mark would otherwise be quoted, invisible, as part of the first line or cell).
TEST(Text, AByteOrderMarkIsIgnoredInBothForms) {
  const Schedule sc = make_schedule("zb-h1", ScheduleOptions{2, 4, 1, BackwardMode::kSplit});
  const std::string bom = "\xEF\xBB\xBF";
  const Schedule text = load_schedule(bom + dump_schedule(sc));
  EXPECT_EQ(dump_schedule(text), dump_schedule(sc));
  PytorchCsvOptions named;
  named.name = sc.name;
  const Schedule csv = from_pytorch_csv(bom + to_pytorch_csv(sc), named);
  EXPECT_EQ(to_pytorch_csv(csv), to_pytorch_csv(sc));
}

TEST(Text, LoadIgnoresCommentsAndBlankLines) {
  const std::string text =
      "# a hand-written schedule\n"
      "\n"
      "twobp-schedule v1 name=mine ranks=1 stages=1 microbatches=2 backward=split placement=0  # header\n"
      "rank 0: F 0 0\n"
      "   rank 0: F 0 1\n"
      "rank 0: I 0 0\n"
      "\n"
      "rank 0: I 0 1   # trailing comment\n"
      "rank 0: W 0 0,1\n";
  const Schedule sc = load_schedule(text);
  EXPECT_EQ(sc.name, "mine");
  EXPECT_EQ(sc.backward, BackwardMode::kSplit);
  ASSERT_EQ(sc.actions.size(), 1u);
  ASSERT_EQ(sc.actions[0].size(), 5u);
  EXPECT_EQ(sc.actions[0][4], (Action{ActionType::kBackwardWeight, 0, {0, 1}}));
  EXPECT_NO_THROW(validate(sc));
  EXPECT_EQ(load_schedule(dump_schedule(sc)).actions, sc.actions);
}

// Files of before wrote "split" for 2bp: they still load, and are written back in today's spelling.
TEST(Text, ReadsTheOldSpellingOfTwoBp) {
  const std::string body =
      " ranks=1 stages=1 microbatches=1 placement=0\nrank 0: F 0 0\nrank 0: I 0 0\nrank 0: W 0 0\n";
  for (const char* spelling : {"split", "2bp"}) {
    SCOPED_TRACE(spelling);
    const Schedule sc = load_schedule(std::string("twobp-schedule v1 name=old backward=") + spelling + body);
    EXPECT_EQ(sc.backward, BackwardMode::kSplit);
    const std::string again = dump_schedule(sc);
    EXPECT_NE(again.find(" backward=2bp "), std::string::npos) << again;
    EXPECT_EQ(load_schedule(again).actions, sc.actions);
  }
}

void expect_load_error(const std::string& text, std::vector<std::string> words) {
  try {
    load_schedule(text);
    ADD_FAILURE() << "expected ScheduleError for:\n" << text;
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    for (const auto& w : words) EXPECT_NE(what.find(w), std::string::npos) << "'" << w << "' not in: " << what;
  }
}

TEST(Text, LoadErrorsNameLineAndExpectation) {
  const std::string header =
      "twobp-schedule v1 name=x ranks=2 stages=2 microbatches=2 backward=standard "
      "placement=0,1\n";
  expect_load_error(header + "rank 0: F 0 0\nrank 0: X 0 1\n",
                    {"line 3", "'rank 0: X 0 1'", "unknown action 'X'", "SEND_F"});
  expect_load_error(header + "rank 2: F 0 0\n", {"line 2", "rank 2 out of range"});
  expect_load_error(header + "rank 0: F 0 7\n", {"line 2", "micro-batch 7 out of range"});
  expect_load_error(header + "rank 0: F 3 0\n", {"stage 3 out of range"});
  expect_load_error(header + "rank 0: F 0 0,1\n", {"only W may list several"});
  expect_load_error(header + "rank 0 F 0 0\n", {"line 2", "expected an action line"});
  expect_load_error(header + "rank 0: F zero 0\n", {"stage to be a non-negative integer", "'zero'"});
  expect_load_error("rank 0: F 0 0\n", {"line 1", "expected the header"});
  expect_load_error("twobp-schedule v2 name=x\n", {"unsupported version 'v2'"});
  expect_load_error("twobp-schedule v1 name=x ranks=2 stages=2 microbatches=2 backward=split\n",
                    {"lacks 'placement='"});
  expect_load_error("twobp-schedule v1 name=x ranks=2 stages=2 microbatches=2 backward=sideways placement=0,1\n",
                    {"backward=standard or backward=2bp (or split)", "'sideways'"});
  expect_load_error("twobp-schedule v1 name=x ranks=2 stages=2 microbatches=2 backward=split placement=0\n",
                    {"placement has 1 entries"});
  expect_load_error("twobp-schedule v1 name=x ranks=2 stages=2 microbatches=2 backward=split placement=0,1 x=1\n",
                    {"unknown header key 'x'"});
  expect_load_error("# only a comment\n", {"no header"});
}

TEST(Text, DumpRejectsUnwritableName) {
  Schedule sc = make_schedule("gpipe", ScheduleOptions{1, 1, 1, BackwardMode::kSplit});
  sc.name = "my schedule";
  EXPECT_THROW(dump_schedule(sc), ScheduleError);
}

// save_schedule_file writes the form its name asks for, which load_schedule_file reads back: the text form exactly,
// PyTorch's CSV as the same compute actions; an unwritable name is an IOError naming it.
TEST(Text, SavedScheduleFilesReadBackByTheirName) {
  const std::string base = ::testing::TempDir() + "/save_schedule_file_test";
  auto contents = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  };
  for (const char* name : {"1f1b", "zb-h1", "interleaved-1f1b", "zb-v"}) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      if (std::string(name).rfind("zb", 0) == 0 && mode == BackwardMode::kStandard) continue;  // 2BP-only
      const Schedule sc = make_schedule(name, default_schedule_options(name, 2, 4, mode));
      SCOPED_TRACE(std::string(name) + " " + to_string(mode));
      save_schedule_file(base + ".txt", sc);
      EXPECT_EQ(contents(base + ".txt"), dump_schedule(sc));
      EXPECT_EQ(dump_schedule(load_schedule_file(base + ".txt")), dump_schedule(sc));
      save_schedule_file(base + ".csv", sc);
      EXPECT_EQ(contents(base + ".csv"), to_pytorch_csv(sc));
      EXPECT_EQ(to_pytorch_csv(load_schedule_file(base + ".csv")), to_pytorch_csv(sc));
    }
  }
  std::remove((base + ".txt").c_str());
  std::remove((base + ".csv").c_str());
  const Schedule sc = make_schedule("1f1b", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  try {
    save_schedule_file("/nonexistent-dir/s.csv", sc);
    FAIL() << "expected IOError";
  } catch (const IOError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/s.csv"), std::string::npos) << e.what();
  }
}

TEST(Text, DescribeAndToString) {
  EXPECT_STREQ(to_string(ActionType::kRecvBackward), "RECV_B");
  EXPECT_EQ(describe(Action{ActionType::kBackwardWeight, 1, {0, 1, 2}}), "W stage 1 micro-batches 0,1,2");
  EXPECT_EQ(describe(Action{ActionType::kForward, 2, {3}}), "F stage 2 micro-batch 3");
}

}  // namespace
}  // namespace twobp
