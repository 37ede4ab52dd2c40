// Fuzz target: the binary token-file reader of include/twobp/data.h (read_token_file), through a real file.

#include <unistd.h>

#include <algorithm>
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

std::optional<std::vector<std::uint16_t>> read(const std::string& path, std::uint32_t vocab) {
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

}  // namespace

int token_file(const std::uint8_t* data, std::size_t size) {
  static constexpr char kMagic[8] = {'T', 'W', 'O', 'B', 'P', 'T', 'O', 'K'};
  static constexpr std::size_t kHeader = 24;
  const std::string& path = scratch_path(0);
  write_bytes(path, data, size);
  const bool has_header = size >= sizeof(kMagic) && std::memcmp(data, kMagic, sizeof(kMagic)) == 0;

  std::optional<std::vector<std::uint16_t>> smaller;  // what a smaller vocabulary read, if it read
  for (const std::uint32_t vocab : {256u, 65536u, 1u << 20}) {
    const auto tokens = read(path, vocab);
    if (!tokens) {
      if (smaller) finding("a file readable with a smaller vocabulary fails with vocab " + std::to_string(vocab));
      continue;
    }
    if (smaller && *smaller != *tokens) finding("the tokens read depend on the vocabulary argument");
    // The format (data.h): with the header exactly 24 + 2n bytes, else an even number of bytes, little-endian.
    const std::size_t offset = has_header ? kHeader : 0;
    if (size < offset || (size - offset) % 2 != 0 || tokens->size() != (size - offset) / 2) {
      finding("read " + std::to_string(tokens->size()) + " tokens from a " + std::to_string(size) +
              "-byte file (header: " + (has_header ? "yes" : "no") + ")");
    }
    for (std::size_t i = 0; i < tokens->size(); ++i) {
      const std::uint16_t expected =
          static_cast<std::uint16_t>(data[offset + 2 * i] | (static_cast<unsigned>(data[offset + 2 * i + 1]) << 8));
      if ((*tokens)[i] != expected) finding("token " + std::to_string(i) + " differs from the file's bytes");
      if ((*tokens)[i] >= vocab) finding("a token >= the vocabulary was accepted");
    }
    // What was read must survive the writer and be read back unchanged.
    const std::uint32_t write_vocab = std::min<std::uint32_t>(vocab, 65536);
    const std::string& copy = scratch_path(1);
    try {
      data::write_token_file(copy, *tokens, write_vocab);
    } catch (const std::exception& e) {
      finding(std::string("write_token_file of tokens just read threw ") + typeid(e).name() + ": " + e.what());
    }
    const auto again = read(copy, write_vocab);
    if (!again || *again != *tokens) finding("write_token_file -> read_token_file changed the tokens");
    smaller = tokens;
  }
  return 0;
}

}  // namespace twobp::fuzz
