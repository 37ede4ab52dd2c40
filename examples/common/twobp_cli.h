#pragma once
// Command-line checks shared by the project's programs (examples/llama_pipeline, benchmarks/twobp_bench): every
// option refused at parse time with one line naming the option, the value and what is allowed (CLI11 prefixes the
// option's name), NaN and infinities refused everywhere; output paths checked before the run; errors printed
// without a backtrace. Header-only, over CLI11 and fmt; a program of your own may copy it.

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/files.h"
#include "twobp/metrics/metrics.h"
#include "twobp/version.h"

namespace twobp::cli {

/// A finite number in [lo, hi]; `meaning` is appended to the message (e.g. " (0: none)").
inline CLI::Validator number_in(double lo, double hi, const std::string& meaning = "") {
  return CLI::Validator(
      [lo, hi, meaning](std::string& text) -> std::string {
        double value = 0;
        std::size_t used = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !std::isfinite(value) || value < lo || value > hi) {
          return fmt::format("must be a finite number in [{:g}, {:g}]{}, got '{}'", lo, hi, meaning, text);
        }
        return std::string();
      },
      fmt::format("in [{:g}, {:g}]", lo, hi));
}

/// Whether anything (file, directory, link target) is at `path`.
inline bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

/// What kind of thing `path` is, where that stops a program: "a FIFO" (opening it blocks until another process
/// opens the other end), "a directory", "a socket"; empty for a regular file, a device (/dev/null) or nothing.
inline std::string blocking_kind(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::string();
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return std::string();
}

/// An input file that exists and is a regular file (CLI::ExistingFile takes a FIFO, on which the program would
/// wait for a writer forever, and a device, which may never end).
inline CLI::Validator regular_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        struct stat st {};
        if (::stat(path.c_str(), &st) != 0) return fmt::format("no such file '{}'", path);
        if (S_ISREG(st.st_mode)) return std::string();
        const std::string kind = blocking_kind(path);
        return fmt::format("'{}' is {}, not a regular file (reading it could block or never end): give a file",
                           path, kind.empty() ? "a device" : kind);
      },
      "regular file");
}

/// An output file this process can write (created and removed again when it did not exist): checked at parse
/// time, so that a bad path fails at once instead of after the run. A directory or socket is refused; a device
/// node or a FIFO is taken if writable (twobp::write_file writes it in place at the end, waiting up to 30 s for a
/// FIFO's reader, and rewrites nothing into it as the run goes).
inline CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        if (path.empty()) return "an empty path: give a file name, or leave the option out";
        std::string target;  // where the write lands: a symbolic link is followed (and kept) by write_file
        try {
          target = final_target(path);
        } catch (const IOError& e) {
          return e.what();
        }
        const std::string kind = blocking_kind(target);
        if (kind == "a FIFO") {
          return ::access(target.c_str(), W_OK) == 0 ? std::string()
                                                   : fmt::format("cannot write the FIFO '{}' (no permission)", path);
        }
        if (!kind.empty()) {
          return fmt::format("'{}' is {}, not a file the program can write: give a regular file", path, kind);
        }
        struct stat st;
        const bool existed = ::stat(target.c_str(), &st) == 0;
        const bool ok = std::ofstream(target, std::ios::app).good();
        if (ok && !existed) std::remove(target.c_str());  // the probe's file, never the link
        return ok ? std::string()
                  : fmt::format("cannot write '{}'{} (no such directory, or no permission)", path,
                                target == path ? "" : fmt::format(" (a link to '{}')", target));
      },
      "writable file");
}

/// An output directory that exists or can be created, and can be written into: checked by creating it (and a
/// file in it) and removing again what the check created, so that a command refused later leaves nothing behind;
/// the program creates it when it first writes there (twobp::make_directories).
inline CLI::Validator writable_directory() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        if (path.empty()) return "an empty path: give a directory, or leave the option out";
        std::vector<std::string> created;  // the directories the check makes, deepest last
        for (std::string missing = path; !missing.empty() && !file_exists(missing);) {
          created.push_back(missing);
          const auto slash = missing.find_last_of('/');
          missing = slash == std::string::npos || slash == 0 ? "" : missing.substr(0, slash);
        }
        bool ok = true;
        try {
          make_directories(path);
        } catch (const IOError&) {
          ok = false;
        }
        const std::string probe = path + "/.twobp_write_probe";
        ok = ok && std::ofstream(probe).good();
        std::remove(probe.c_str());
        for (const std::string& dir : created) ::rmdir(dir.c_str());  // deepest first
        return ok ? std::string() : fmt::format("cannot create or write into the directory '{}'", path);
      },
      "writable directory");
}

/// `path` made absolute with its links resolved; one not there yet: its directory resolved, then its name.
inline std::string resolved_path(const std::string& path) {
  auto real = [](const std::string& p) -> std::optional<std::string> {
    char buffer[PATH_MAX];
    if (::realpath(p.c_str(), buffer) == nullptr) return std::nullopt;
    return std::string(buffer);
  };
  if (auto full = real(path)) return *full;
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (auto full = real(dir)) return *full + "/" + name;
  return path;
}

/// Throws twobp::UsageError when two of `outputs` (option, path; empty paths skipped), or an output and one of
/// `inputs`, name the same file: one would overwrite the other, or the input, without a word. Devices
/// (/dev/null) may be shared.
inline void refuse_shared_paths(const std::vector<std::pair<std::string, std::string>>& outputs,
                                const std::vector<std::pair<std::string, std::string>>& inputs = {}) {
  auto is_device = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode));
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const auto& [option, path] = outputs[i];
    if (path.empty() || is_device(path)) continue;
    const std::string mine = resolved_path(path);
    for (std::size_t j = i + 1; j < outputs.size() + inputs.size(); ++j) {
      const auto& [other, other_path] = j < outputs.size() ? outputs[j] : inputs[j - outputs.size()];
      if (other_path.empty() || resolved_path(other_path) != mine) continue;
      throw twobp::UsageError(fmt::format("{} and {} name the same file '{}': {}; give each output a path of its own",
                                          option, other, path,
                                          j < outputs.size() ? "one output would overwrite the other"
                                                             : "the output would overwrite the input"));
    }
  }
}

/// A name of the library's vocabulary, read by its parse function (twobp::parse_precision, parse_backward_mode):
/// refused with that function's message, else rewritten to its one spelling (to_string), so that the program sees
/// "bf16" for "bf16-mixed". `shown` is what --help lists.
template <class Parse>
CLI::Validator one_spelling(Parse parse, const std::string& shown) {
  return CLI::Validator(
      [parse](std::string& text) -> std::string {
        try {
          text = to_string(parse(text));
        } catch (const std::exception& e) {
          return e.what();
        }
        return std::string();
      },
      shown);
}

/// Counts and sizes: at most this much (a bound that keeps every product and allocation within range).
inline constexpr double kMaxCount = 1e6;
/// Ranks and replicas run by one process or job.
inline constexpr double kMaxRanks = 1024;

/// Refuses (twobp::UsageError) `dp` x `ranks` rank threads beyond what one process runs, before any thread starts.
inline void check_rank_threads(double dp, double ranks) {
  if (dp * ranks <= kMaxRanks) return;
  throw twobp::UsageError(fmt::format("--dp {:g} x --ranks {:g} = {:g} rank threads, more than the {:g} one process "
                                      "runs; use fewer, or a launcher (mpirun, torchrun, srun: one rank per process)",
                                      dp, ranks, dp * ranks, kMaxRanks));
}

/// `--version`: prints twobp::version_line(program) (twobp's version and commit, LibTorch's version) and exits.
inline void add_version_flag(CLI::App& app, const std::string& program) {
  app.set_version_flag("--version", twobp::version_line(program), "Print twobp's version, commit and LibTorch's");
}

/// The name in `names` closest to `given` within two edits, or "" when none is. An edit is an insertion, a
/// deletion, a substitution or a swap of two neighbours ("stpes" is one edit from "steps"); ties go to the first.
inline std::string closest_name(const std::string& given, const std::vector<std::string>& names) {
  std::string best;
  std::size_t best_distance = 3;  // at most two edits
  for (const std::string& name : names) {
    // The distance table (optimal string alignment), rows of `given` against columns of `name`.
    std::vector<std::vector<std::size_t>> d(given.size() + 1, std::vector<std::size_t>(name.size() + 1));
    for (std::size_t i = 0; i <= given.size(); ++i) d[i][0] = i;
    for (std::size_t j = 0; j <= name.size(); ++j) d[0][j] = j;
    for (std::size_t i = 1; i <= given.size(); ++i) {
      for (std::size_t j = 1; j <= name.size(); ++j) {
        d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (given[i - 1] == name[j - 1] ? 0 : 1)});
        if (i > 1 && j > 1 && given[i - 1] == name[j - 2] && given[i - 2] == name[j - 1]) {
          d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
        }
      }
    }
    if (d[given.size()][name.size()] < best_distance) {
      best_distance = d[given.size()][name.size()];
      best = name;
    }
  }
  return best;
}

/// For a first argument that is no subcommand of `app` (which has subcommands) and no option: the closest
/// subcommand name within two edits ("did you mean 'split'?"), or the list of them. Empty where not applicable.
inline std::string subcommand_suggestion(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return "";
  const std::string given = argv[1];
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == given) return "";
    names.push_back(sub->get_name());
  }
  if (names.empty()) return "";
  const std::string best = closest_name(given, names);
  return best.empty() ? fmt::format("unknown command '{}'; the commands are {}", given, fmt::join(names, ", "))
                      : fmt::format("unknown command '{}'; did you mean '{}'?", given, best);
}

/// For each "--name" (or "--name=value") in argv that is no option of `app` or of the subcommand it chose: the
/// closest option within two edits ("unknown option '--stpes'; did you mean '--steps'?"). Empty when none.
inline std::string option_suggestion(const CLI::App& app, int argc, char** argv) {
  std::vector<std::string> names;
  auto add_options = [&names](const CLI::App& a) {
    for (const CLI::Option* option : a.get_options()) {
      for (const std::string& name : option->get_lnames()) names.push_back("--" + name);
    }
  };
  add_options(app);
  for (const CLI::App* sub : app.get_subcommands()) add_options(*sub);
  std::vector<std::string> lines;
  for (int k = 1; k < argc; ++k) {
    const std::string arg = argv[k];
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) continue;
    const std::string given = arg.substr(0, arg.find('='));
    if (std::find(names.begin(), names.end(), given) != names.end()) continue;
    const std::string best = closest_name(given, names);
    if (!best.empty()) lines.push_back(fmt::format("unknown option '{}'; did you mean '{}'?", given, best));
  }
  return fmt::format("{}", fmt::join(lines, "\n"));
}

/// Parses the command line (and, for a program with subcommands, runs the chosen one's callback); on a bad one
/// prints CLI11's message (and, for a mistyped subcommand, the closest name) and returns 2, the status of every
/// usage error (the checks made after parsing throw twobp::UsageError, which programs turn into 2 as well:
/// failure_status), instead of CLI11's code per kind of error (105, 106, ...). --help and --version print and
/// return 0; a subcommand that failed with CLI::RuntimeError(code) returns its code. nullopt: go on.
inline std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    const int status = app.exit(e);
    if (status == 0) return 0;
    const std::string program = std::string(argv[0]).substr(std::string(argv[0]).find_last_of('/') + 1);
    const std::string command = subcommand_suggestion(app, argc, argv);
    if (!command.empty()) fmt::print(stderr, "{}: {}\n", program, command);
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      const std::string option = option_suggestion(app, argc, argv);
      if (!option.empty()) fmt::print(stderr, "{}: {}\n", program, option);
    }
    return 2;
  }
  return std::nullopt;
}

/// An error's message without the C++ backtrace LibTorch appends to its own (c10::Error) errors.
inline std::string error_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

/// A program's exit status for an error that ended it: 2 for twobp's own errors (bad input refused with its
/// reason: options, files, layouts), as for a bad command line; 1 for anything else.
inline int failure_status(const std::exception& e) {
  return dynamic_cast<const twobp::Error*>(&e) != nullptr ? 2 : 1;
}

/// A program's JSON output (nlohmann's json or ordered_json), indented, written whole or not at all
/// (twobp::write_file); IOError naming the file.
template <typename Json>
void write_json(const std::string& path, const Json& json) {
  write_file(path, json.dump(2) + "\n", "output");
}

/// Prints metrics::load_warning on stderr when the machine is loaded (where a program prints timings); returns
/// the load average.
inline double warn_if_loaded(const std::string& command, const std::string& quieter) {
  const double load = metrics::load_average();
  const std::string warning = metrics::load_warning(command, quieter, load);
  if (!warning.empty()) fmt::print(stderr, "{}\n", warning);
  return load;
}

}  // namespace twobp::cli
