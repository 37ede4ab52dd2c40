#pragma once
// Option checks shared by the twobp_bench commands: one line naming the option, the value and what is allowed,
// before anything runs (CLI11 prefixes the option's name). NaN and infinities are refused everywhere.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace twobp::bench {

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

/// An output file this process can write (created and removed again when it did not exist): checked at parse
/// time, so that a bad path fails at once instead of after the run.
inline CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        if (path.empty()) return std::string();
        const bool existed = std::filesystem::exists(path);
        const bool ok = std::ofstream(path, std::ios::app).good();
        if (ok && !existed) std::remove(path.c_str());
        return ok ? std::string() : fmt::format("cannot write '{}' (no such directory, or no permission)", path);
      },
      "writable file");
}

/// An output directory that exists or can be created, and can be written into.
inline CLI::Validator writable_directory() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        if (path.empty()) return std::string();
        std::error_code ec;
        std::filesystem::create_directories(path, ec);
        const std::string probe = path + "/.twobp_write_probe";
        const bool ok = !ec && std::filesystem::is_directory(path) && std::ofstream(probe).good();
        std::remove(probe.c_str());
        return ok ? std::string() : fmt::format("cannot create or write into the directory '{}'", path);
      },
      "writable directory");
}

/// Counts and sizes: at most this much (a bound that keeps every product and allocation within range).
inline constexpr double kMaxCount = 1e6;
/// Ranks and replicas run by one process or job of this benchmark.
inline constexpr double kMaxRanks = 1024;

}  // namespace twobp::bench
