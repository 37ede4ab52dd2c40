#pragma once
// Helpers shared by the twobp_bench subcommands: wall-clock timing, robust statistics over repetitions, JSON
// output (nlohmann/json) with a read-back check, and a plain-text table. No torch here (keeps this TU cheap).

#include <nlohmann/json.hpp>

#include <cstddef>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "twobp/schedule/schedule.h"  // BackwardMode (no torch)

namespace twobp::bench {

using Json = nlohmann::ordered_json;  // keeps keys in insertion order: readable files

/// What time_ms measures.
enum class Clock {
  kWall,  ///< steady clock: what a user waits for
  /// CPU time of the whole process. On a shared machine it does not count time the process waited for a core,
  /// so it is the steadier measure with --threads 1; with more threads it also counts the spin-waiting of the
  /// OpenMP workers, so it is no measure of speed then.
  kProcessCpu,
};
Clock parse_clock(const std::string& name);  // "wall" | "cpu"; throws std::invalid_argument
const char* clock_name(Clock clock);
/// Now, in milliseconds, on `clock` (arbitrary origin).
double now_ms(Clock clock);

/// Milliseconds spent in fn(). CPU ops are synchronous; GPU callers must synchronise inside fn.
template <typename Fn>
double time_ms(Fn&& fn, Clock clock = Clock::kWall) {
  const double start = now_ms(clock);
  std::forward<Fn>(fn)();
  return now_ms(clock) - start;
}

/// Order statistics of one series of samples (linear interpolation between order statistics).
struct Summary {
  double min = 0, p25 = 0, median = 0, p75 = 0, max = 0;
  std::size_t count = 0;
};
Summary summarize(std::vector<double> samples);
/// {"min":..,"p25":..,"median":..,"p75":..,"max":..,"n":..}
Json to_json(const Summary& s);

/// Samples collected per named series (e.g. "fused_ms"), in the order the names were first used.
class Series {
 public:
  void add(const std::string& name, double value);
  const std::vector<double>& get(const std::string& name) const;  // throws std::out_of_range when unknown
  bool has(const std::string& name) const;
  double median(const std::string& name) const { return summarize(get(name)).median; }
  /// {"<name>": Summary...} for every series.
  Json spread() const;

 private:
  std::vector<std::pair<std::string, std::vector<double>>> series_;
};

/// The 1-minute load average from /proc/loadavg (-1 when unavailable): recorded so that noisy runs show it.
double load_average();

void write_json(const std::string& path, const Json& json);
/// Writes `text` to `path`; throws naming the file when it cannot be opened or written (never a silent "wrote").
void write_text(const std::string& path, const std::string& text);
Json read_json(const std::string& path);

/// Checks that every `paths` entry ("a/b/c" = json["a"]["b"]["c"]) exists in `json` and is a finite number
/// (> 0 when `positive`). Returns one message per violation; empty means valid.
std::vector<std::string> check_numbers(const Json& json, const std::vector<std::string>& paths, bool positive);

/// A fixed-width text table: the first row is the header.
void print_table(std::ostream& os, const std::vector<std::vector<std::string>>& rows);
/// `value` with `digits` decimals.
std::string fmt_num(double value, int digits = 2);

/// "standard" or "2bp": how every twobp_bench output names a backward mode.
const char* mode_name(BackwardMode mode);

/// A command-line list of names: "all" (every `known` name) or names of `known` separated by commas, in the given
/// order. Throws std::invalid_argument naming the unknown one, `what` it should be ("schedule") and the known ones.
std::vector<std::string> name_list(const std::string& value, const std::vector<std::string>& known,
                                   const std::string& what);

}  // namespace twobp::bench
