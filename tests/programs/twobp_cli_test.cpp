// examples/common/twobp_cli.h, in-process: the one numeric check every option of the programs uses refuses every
// kind of bad value and keeps the bounds. programs_bad_inputs checks that each option of each program declares it
// (its --help) and is refused end to end; this test covers the values, so that the replay needs one per option.
// Also parse()'s exit statuses (2 for every usage error, a subcommand's own status kept) and the suggestion for a
// mistyped subcommand.

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "twobp/error.h"

#include "twobp_cli.h"

namespace {

// What number_in(lo, hi) makes of `text`: "" when it accepts it, else its message.
std::string check(double lo, double hi, std::string text) { return twobp::cli::number_in(lo, hi)(text); }

TEST(NumberIn, RefusesEveryKindOfBadValue) {
  for (const std::string bad : {"nan", "NaN", "-nan", "inf", "-inf", "infinity", "1e300", "-1e300", "", "abc", "1x",
                                "2 ", "0x", "--1", "1e1000"}) {
    const std::string message = check(0, 10, bad);
    EXPECT_NE(message.find("must be a finite number in [0, 10]"), std::string::npos) << "'" << bad << "': " << message;
    EXPECT_NE(message.find("got '" + bad + "'"), std::string::npos) << message;
  }
  // Below and above the bounds, for each kind of lower bound the programs use (-1, 0, 1).
  EXPECT_NE(check(0, 10, "-1"), "");
  EXPECT_NE(check(1, 10, "0"), "");
  EXPECT_NE(check(-1, 10, "-2"), "");
  EXPECT_NE(check(0, 10, "10.5"), "");
  EXPECT_NE(check(1, 1e6, "1e300"), "");
}

TEST(NumberIn, AcceptsTheBoundsAndWhatIsBetween) {
  for (const std::string good : {"0", "10", "5", "2.5", "1e1", "0.0", "-0"}) {
    EXPECT_EQ(check(0, 10, good), "") << good;
  }
  EXPECT_EQ(check(-1, 10, "-1"), "");
  EXPECT_EQ(check(1, 1e6, "1000000"), "");
}

TEST(NumberIn, ItsDescriptionIsWhatTheReplayReads) {
  // programs_bad_inputs reads each option's bounds from --help, where CLI11 prints this description.
  EXPECT_EQ(twobp::cli::number_in(1, 1e6).get_description(), "in [1, 1e+06]");
  EXPECT_EQ(twobp::cli::number_in(-1, 1e9).get_description(), "in [-1, 1e+09]");
}

TEST(NumberIn, AnOptionDeclaredWithItRefusesAtParseTime) {
  CLI::App app;
  int steps = 1;
  app.add_option("--steps", steps)->check(twobp::cli::number_in(1, 1e6));
  std::vector<std::string> args{"--steps", "nan"};  // CLI11 takes them in reverse order
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
    FAIL() << "--steps nan was accepted";
  } catch (const CLI::ValidationError& e) {
    EXPECT_NE(std::string(e.what()).find("--steps"), std::string::npos) << e.what();
  }
  EXPECT_EQ(steps, 1);
}

// parse() over an argv, as main() gets it.
std::optional<int> parse(CLI::App& app, std::vector<std::string> args) {
  args.insert(args.begin(), "program");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return twobp::cli::parse(app, static_cast<int>(argv.size()), argv.data());
}

// A program with subcommands, as twobp_bench: "split" succeeds, "check" fails with its own status 3.
void add_commands(CLI::App& app) {
  app.require_subcommand(1);
  app.add_subcommand("split", "")->callback([] {});
  app.add_subcommand("simulate", "");
  app.add_subcommand("check", "")->callback([] { throw CLI::RuntimeError(3); });
}

TEST(Parse, UsageErrorsExitTwoHelpZeroAndASubcommandsStatusIsKept) {
  {
    CLI::App app;
    add_commands(app);
    EXPECT_EQ(parse(app, {"split"}), std::nullopt);
  }
  {
    CLI::App app;
    add_commands(app);
    EXPECT_EQ(parse(app, {"split", "--no-such-option"}), 2);  // CLI11 alone: 109
  }
  {
    CLI::App app;
    add_commands(app);
    EXPECT_EQ(parse(app, {}), 2);  // no subcommand: CLI11 alone 106
  }
  {
    CLI::App app;
    add_commands(app);
    EXPECT_EQ(parse(app, {"--help"}), 0);
  }
  {
    CLI::App app;
    add_commands(app);
    EXPECT_EQ(parse(app, {"check"}), 3);
  }
}

TEST(Parse, AMistypedSubcommandIsToldTheClosestOne) {
  CLI::App app;
  add_commands(app);
  auto suggestion = [&](std::string first) {
    std::vector<std::string> args{"program", first};
    std::vector<char*> argv{args[0].data(), args[1].data()};
    return twobp::cli::subcommand_suggestion(app, 2, argv.data());
  };
  EXPECT_EQ(suggestion("splt"), "unknown command 'splt'; did you mean 'split'?");
  EXPECT_EQ(suggestion("simualte"), "unknown command 'simualte'; did you mean 'simulate'?");
  EXPECT_EQ(suggestion("benchmark"), "unknown command 'benchmark'; the commands are split, simulate, check");
  EXPECT_EQ(suggestion("split"), "");       // a subcommand
  EXPECT_EQ(suggestion("--ranks"), "");     // an option
}

TEST(FailureStatus, TwobpsOwnErrorsAreUsageErrors) {
  EXPECT_EQ(twobp::cli::failure_status(twobp::UsageError("bad")), 2);
  EXPECT_EQ(twobp::cli::failure_status(std::runtime_error("crash")), 1);
}

}  // namespace
