// The one vocabulary: every enum's to_string() and parse function, read back by each other, aliases and errors.

#include <gtest/gtest.h>

#include <string>

#include "twobp/error.h"
#include "twobp/precision.h"
#include "twobp/schedule/schedule.h"

namespace twobp {
namespace {

// The message of the UsageError `f` throws; fails the test when it throws none.
template <class F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UsageError";
  return {};
}

TEST(Vocabulary, BackwardModeRoundTrips) {
  EXPECT_STREQ(to_string(BackwardMode::kStandard), "standard");
  EXPECT_STREQ(to_string(BackwardMode::kSplit), "2bp");
  for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
    EXPECT_EQ(parse_backward_mode(to_string(mode)), mode) << to_string(mode);
  }
}

TEST(Vocabulary, BackwardModeAliases) {
  EXPECT_EQ(parse_backward_mode("split"), BackwardMode::kSplit);  // schedule files of before
  EXPECT_EQ(parse_backward_mode("2BP"), BackwardMode::kSplit);
  EXPECT_EQ(parse_backward_mode("fused"), BackwardMode::kStandard);
  EXPECT_EQ(parse_backward_mode("fused-backward"), BackwardMode::kStandard);
}

TEST(Vocabulary, BackwardModeErrorsNameTheSpellings) {
  for (const char* bad : {"", "both", "Standard", "2bp ", "zb"}) {
    const std::string what = usage_error([&] { parse_backward_mode(bad); });
    EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
    EXPECT_NE(what.find("standard or 2bp"), std::string::npos) << what;
  }
}

TEST(Vocabulary, PrecisionRoundTrips) {
  EXPECT_STREQ(to_string(Precision::kFloat32), "fp32");
  EXPECT_STREQ(to_string(Precision::kMixedBFloat16), "bf16");
  EXPECT_STREQ(to_string(Precision::kBFloat16), "bf16-pure");
  EXPECT_STREQ(to_string(Precision::kFloat64), "fp64");
  for (Precision p : {Precision::kFloat32, Precision::kMixedBFloat16, Precision::kBFloat16, Precision::kFloat64}) {
    EXPECT_EQ(parse_precision(to_string(p)), p) << to_string(p);
  }
  EXPECT_EQ(compute_dtype(Precision::kFloat32), c10::kFloat);
  EXPECT_EQ(compute_dtype(Precision::kMixedBFloat16), c10::kBFloat16);
  EXPECT_EQ(compute_dtype(Precision::kBFloat16), c10::kBFloat16);
  EXPECT_EQ(compute_dtype(Precision::kFloat64), c10::kDouble);
  EXPECT_EQ(parse_precision("float64"), Precision::kFloat64);
}

TEST(Vocabulary, PrecisionAliases) {
  EXPECT_EQ(parse_precision("float32"), Precision::kFloat32);
  EXPECT_EQ(parse_precision("bf16-mixed"), Precision::kMixedBFloat16);  // the memory model's name of before
  EXPECT_EQ(parse_precision("pure-bf16"), Precision::kBFloat16);
}

TEST(Vocabulary, PrecisionErrors) {
  // "bfloat16" could mean either form: refused, naming both.
  std::string what = usage_error([] { parse_precision("bfloat16"); });
  EXPECT_NE(what.find("ambiguous"), std::string::npos) << what;
  EXPECT_NE(what.find("bf16-pure"), std::string::npos) << what;
  EXPECT_NE(what.find("mixed"), std::string::npos) << what;
  what = usage_error([] { parse_precision("fp16"); });
  EXPECT_NE(what.find("not supported"), std::string::npos) << what;
  what = usage_error([] { parse_precision("fp8"); });
  EXPECT_NE(what.find("unknown precision 'fp8'"), std::string::npos) << what;
  EXPECT_NE(what.find("fp32, bf16"), std::string::npos) << what;
}

}  // namespace
}  // namespace twobp
