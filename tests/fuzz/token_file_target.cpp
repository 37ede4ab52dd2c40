// Fuzz target: the binary token-file reader of include/twobp/data.h (read_token_file), through a real file.

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "fuzz_targets.h"
#include "twobp/data.h"
#include "twobp/error.h"

namespace twobp::fuzz {
namespace {

const std::string& scratch_path(int which) {
  static const std::string base =
      (std::filesystem::temp_directory_path() / ("twobp-fuzz-" + std::to_string(::getpid()))).string();
  static const struct Paths {
    std::string p[2];
    ~Paths() {
      for (const auto& path : p) std::remove(path.c_str());
    }
  } paths{{base + "-in.tok", base + "-rt.tok"}};
  return paths.p[which];
}

void write_bytes(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) finding("cannot create the scratch file " + path);
  if (size > 0 && std::fwrite(data, 1, size, f) != size) finding("cannot write the scratch file " + path);
  std::fclose(f);
}

std::optional<data::Tokens> read(const std::string& path, std::uint32_t vocab) {
  try {
    return data::read_token_file(path, vocab);
  } catch (const IOError&) {
    return std::nullopt;
  } catch (const UsageError&) {
    return std::nullopt;
  } catch (const std::exception& e) {
    finding("read_token_file(vocab " + std::to_string(vocab) + ") threw " + typeid(e).name() + ": " + e.what());
  } catch (...) {
    finding("read_token_file threw a non-std exception");
  }
}

// Little-endian unsigned integer of `width` bytes at `p`.
std::uint32_t le(const std::uint8_t* p, std::size_t width) {
  std::uint32_t value = 0;
  for (std::size_t i = 0; i < width; ++i) value |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return value;
}

}  // namespace

int token_file(const std::uint8_t* data, std::size_t size) {
  static constexpr char kMagic[8] = {'T', 'W', 'O', 'B', 'P', 'T', 'O', 'K'};
  const std::string& path = scratch_path(0);
  write_bytes(path, data, size);
  const bool has_header = size >= sizeof(kMagic) && std::memcmp(data, kMagic, sizeof(kMagic)) == 0;

  std::optional<data::Tokens> smaller;  // what a smaller vocabulary read, if it read
  for (const std::uint32_t vocab : {256u, 65536u, 1u << 20}) {
    const auto tokens = read(path, vocab);
    if (!tokens) {
      if (smaller) finding("a file readable with a smaller vocabulary fails with vocab " + std::to_string(vocab));
      continue;
    }
    if (smaller && *smaller != *tokens) finding("the tokens read depend on the vocabulary argument");
    // The format (data.h): a version-1 header (24 bytes) or none, then 16-bit tokens; a version-2 header (32 bytes)
    // with the token width at offset 24, then tokens of that width; exactly header + width * n bytes.
    // Little-endian.
    const bool v2 = has_header && size >= 12 && le(data + 8, 4) == 2;
    const std::size_t offset = has_header ? (v2 ? 32 : 24) : 0;
    const std::size_t width = v2 && size >= 28 ? le(data + 24, 4) / 8 : 2;
    if (size < offset || (width != 2 && width != 4) || (size - offset) % width != 0 ||
        tokens->size() != (size - offset) / width) {
      finding("read " + std::to_string(tokens->size()) + " tokens from a " + std::to_string(size) +
              "-byte file (header: " + (has_header ? (v2 ? "version 2" : "version 1") : "no") + ")");
    }
    for (std::size_t i = 0; i < tokens->size(); ++i) {
      if ((*tokens)[i] != le(data + offset + width * i, width)) {
        finding("token " + std::to_string(i) + " differs from the file's bytes");
      }
      if ((*tokens)[i] >= vocab) finding("a token >= the vocabulary was accepted");
    }
    // What was read must survive the writer (16 or 32 bits, as the vocabulary needs) and be read back unchanged.
    const std::string& copy = scratch_path(1);
    try {
      data::write_token_file(copy, *tokens, vocab);
    } catch (const std::exception& e) {
      finding(std::string("write_token_file of tokens just read threw ") + typeid(e).name() + ": " + e.what());
    }
    const auto again = read(copy, vocab);
    if (!again || *again != *tokens) finding("write_token_file -> read_token_file changed the tokens");
    smaller = tokens;
  }
  return 0;
}

}  // namespace twobp::fuzz
