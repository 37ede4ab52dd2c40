#pragma once
// Fuzz targets shared by the libFuzzer executables (TWOBP_BUILD_FUZZERS=ON, clang) and the corpus replay test of
// the ordinary build (tests/fuzz/replay_main.cpp). Each target takes arbitrary bytes and returns 0; a finding
// (an exception other than the documented error types, a broken invariant) prints what went wrong and aborts,
// which libFuzzer records as a crash and the replay test as a failed run. Memory errors and hangs are found by
// the sanitizers and libFuzzer's timeouts around these functions.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace twobp::fuzz {

/// load_schedule() on the bytes; when they parse: validate(), and dump_schedule() -> load_schedule() must give
/// back an equal schedule. Only ScheduleError / UsageError may escape the library.
int schedule_text(const std::uint8_t* data, std::size_t size);

/// The bytes as a token file: data::read_token_file() with vocabularies 256, 65536 and 2^20. A file that reads
/// must hold as many tokens as its size says, all below the vocabulary, and survive write_token_file() ->
/// read_token_file() unchanged. Only IOError / UsageError may escape.
int token_file(const std::uint8_t* data, std::size_t size);

/// The bytes as a safetensors file: checkpoint::SafetensorsFile (mapped). A file that opens must give, for every
/// tensor, exactly the file's bytes at its header's offsets (inside the file), and what reads must survive
/// safetensors_bytes() -> SafetensorsFile unchanged. Only UsageError may escape the reader (a BOOL byte other than
/// 0/1 is refused by read(), as documented).
int safetensors_file(const std::uint8_t* data, std::size_t size);

struct Target {
  const char* name;  ///< also the corpus directory: tests/fuzz/corpus/<name>/
  int (*run)(const std::uint8_t*, std::size_t);
};

inline const std::vector<Target>& targets() {
  static const std::vector<Target> kTargets = {
      {"schedule_text", &schedule_text}, {"token_file", &token_file}, {"safetensors_file", &safetensors_file}};
  return kTargets;
}

/// Prints "twobp fuzz finding: <what>" (and the input's name, if the replay test set one) and aborts.
[[noreturn]] void finding(const std::string& what);

/// Name of the input being replayed, printed by finding(); empty under libFuzzer (it names the crash file).
void set_current_input(std::string name);

}  // namespace twobp::fuzz
