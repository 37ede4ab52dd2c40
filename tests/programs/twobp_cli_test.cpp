// examples/common/twobp_cli.h, in-process: the one numeric check every option of the programs uses refuses every
// kind of bad value and keeps the bounds; file options refuse what would block (FIFOs) or overwrite another path;
// rank threads are bounded. programs_bad_inputs checks that each option of each program declares it
// (its --help) and is refused end to end; this test covers the values, so that the replay needs one per option.
// Also parse()'s exit statuses (2 for every usage error, a subcommand's own status kept) and the suggestion for a
// mistyped subcommand.

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
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

// A mistyped option (of the program or of the chosen command) is told the closest one, like a mistyped command.
TEST(Parse, AMistypedOptionIsToldTheClosestOne) {
  CLI::App app;
  int steps = 0, ranks = 0;
  app.add_option("--steps", steps);
  CLI::App* sub = app.add_subcommand("simulate", "");
  sub->add_option("--ranks", ranks);
  std::vector<std::string> args{"program", "simulate", "--rnaks", "2", "--stpes=3", "--unrelated-thing", "--ranks"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
  }
  EXPECT_EQ(twobp::cli::option_suggestion(app, static_cast<int>(argv.size()), argv.data()),
            "unknown option '--rnaks'; did you mean '--ranks'?\nunknown option '--stpes'; did you mean '--steps'?");
  EXPECT_EQ(twobp::cli::closest_name("--dtpye", {"--dtype", "--device"}), "--dtype");
  EXPECT_EQ(twobp::cli::closest_name("--stpes", {"--stages", "--steps"}), "--steps");  // a swap is one edit
  EXPECT_EQ(twobp::cli::closest_name("--everything", {"--dtype", "--device"}), "");
}

TEST(FailureStatus, TwobpsOwnErrorsAreUsageErrors) {
  EXPECT_EQ(twobp::cli::failure_status(twobp::UsageError("bad")), 2);
  EXPECT_EQ(twobp::cli::failure_status(std::runtime_error("crash")), 1);
}

// A fresh directory holding a regular file, a FIFO, a directory and a socket, removed at the end.
class Paths : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/twobp_cli_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    std::ofstream(file()) << "x";
    ASSERT_EQ(::mkfifo(fifo().c_str(), 0600), 0);
    ASSERT_EQ(::mkdir(subdir().c_str(), 0700), 0);
    socket_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", socket_path().c_str());
    ASSERT_EQ(::bind(socket_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  }
  void TearDown() override {
    ::close(socket_);
    for (const std::string& p : {file(), fifo(), socket_path(), dir_ + "/new.json"}) std::remove(p.c_str());
    ::rmdir(subdir().c_str());
    ::rmdir(dir_.c_str());
  }
  std::string file() const { return dir_ + "/file.txt"; }
  std::string fifo() const { return dir_ + "/fifo"; }
  std::string subdir() const { return dir_ + "/dir"; }
  std::string socket_path() const { return dir_ + "/socket"; }

  std::string dir_;
  int socket_ = -1;
};

std::string validate(const CLI::Validator& v, std::string text) { return v(text); }

// Inputs: only a regular file is read (a FIFO would wait for a writer forever); outputs: a directory or a socket
// is refused at parse time, a new or regular file, a device or a FIFO is taken (twobp::write_file writes those in
// place, waiting a bounded time for a FIFO's reader).
TEST_F(Paths, OnlyFilesThatCannotBlockAreTaken) {
  const CLI::Validator input = twobp::cli::regular_file(), output = twobp::cli::writable_file();
  EXPECT_EQ(validate(input, file()), "");
  for (const std::string& bad : {fifo(), subdir(), socket_path(), std::string("/dev/null"), dir_ + "/missing"}) {
    const std::string message = validate(input, bad);
    EXPECT_NE(message, "") << bad;
    EXPECT_NE(message.find(bad), std::string::npos) << message;
  }
  EXPECT_NE(validate(input, fifo()).find("a FIFO"), std::string::npos);
  for (const std::string& good : {file(), dir_ + "/new.json", std::string("/dev/null"), fifo()}) {
    EXPECT_EQ(validate(output, good), "") << good;
  }
  EXPECT_NE(validate(output, "").find("an empty path"), std::string::npos);  // --json '' would write nothing
  // A symbolic link to a file not there yet: taken, and the check leaves the link (and no target) behind.
  const std::string link = dir_ + "/link.json";
  ASSERT_EQ(::symlink("new.json", link.c_str()), 0);
  EXPECT_EQ(validate(output, link), "");
  struct stat st {};
  EXPECT_EQ(::lstat(link.c_str(), &st), 0) << "the check removed the link";
  EXPECT_NE(::stat((dir_ + "/new.json").c_str(), &st), 0) << "the check left its probe file";
  std::remove(link.c_str());
  for (const std::string& bad : {subdir(), socket_path()}) {
    const std::string message = validate(output, bad);
    EXPECT_NE(message.find(twobp::cli::blocking_kind(bad)), std::string::npos) << message;
    EXPECT_NE(message.find("regular file"), std::string::npos) << message;
  }
}

// An output directory is checked, never created at parse time: a command refused after parsing leaves nothing.
TEST_F(Paths, AnOutputDirectoryIsCheckedNotCreated) {
  const CLI::Validator output = twobp::cli::writable_directory();
  EXPECT_EQ(validate(output, subdir()), "");
  const std::string fresh = dir_ + "/new/deeper";
  EXPECT_EQ(validate(output, fresh), "");
  struct stat st {};
  EXPECT_NE(::stat((dir_ + "/new").c_str(), &st), 0) << "the validator created the directory";
  EXPECT_NE(validate(output, "").find("an empty path"), std::string::npos);  // --checkpoint-dir '' saved nothing
  const std::string under_file = file() + "/ck";
  const std::string message = validate(output, under_file);
  EXPECT_NE(message.find(under_file), std::string::npos) << message;
  EXPECT_NE(validate(output, "/proc/twobp-nonexistent/out"), "");  // not even root can create it
}

// One file given to two outputs, or to an output and an input, however it is spelled (relative, with ./ and ..,
// through a link); empty paths and devices are not compared; inputs may share a file.
TEST_F(Paths, OneFileForTwoOutputsIsRefusedHoweverSpelled) {
  using Named = std::vector<std::pair<std::string, std::string>>;
  const std::string link = dir_ + "/link.txt";
  ASSERT_EQ(::symlink(file().c_str(), link.c_str()), 0);
  const std::string fresh = dir_ + "/new.json";
  for (const std::string& spelled : {file(), dir_ + "/./file.txt", subdir() + "/../file.txt", link}) {
    try {
      twobp::cli::refuse_shared_paths({{"--json", file()}, {"--trace", spelled}});
      ADD_FAILURE() << "--json and --trace both " << spelled;
    } catch (const twobp::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--json and --trace"), std::string::npos) << e.what();
    }
    EXPECT_THROW(twobp::cli::refuse_shared_paths({{"--json", spelled}}, {{"--data", file()}}), twobp::UsageError);
  }
  // Not there yet: compared by directory and name.
  EXPECT_THROW(
      twobp::cli::refuse_shared_paths({{"--json", fresh}, {"--csv", ""}, {"--chart", subdir() + "/../new.json"}}),
      twobp::UsageError);
  const Named apart{{"--json", fresh}, {"--trace", subdir() + "/t.json"}, {"--csv", ""}, {"--chart", ""},
                    {"--a", "/dev/null"}, {"--b", "/dev/null"}};
  EXPECT_NO_THROW(twobp::cli::refuse_shared_paths(apart, Named{{"--data", link}, {"--schedule-file", file()}}));
  std::remove(link.c_str());
}

TEST(RankThreads, MoreThanOneProcessRunsAreRefusedNamingBothOptions) {
  EXPECT_NO_THROW(twobp::cli::check_rank_threads(1, twobp::cli::kMaxRanks));
  EXPECT_NO_THROW(twobp::cli::check_rank_threads(4, 256));
  for (const auto& [dp, ranks] : std::vector<std::pair<double, double>>{{1000, 2}, {1, 1025}, {1024, 1024}, {3, 342}}) {
    try {
      twobp::cli::check_rank_threads(dp, ranks);
      ADD_FAILURE() << dp << " x " << ranks;
    } catch (const twobp::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--dp"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--ranks"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
