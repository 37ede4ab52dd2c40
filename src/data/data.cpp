#include "twobp/data.h"

#include <ATen/ATen.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "twobp/files.h"
#include "util/hash.h"
#include "util/check.h"

namespace twobp::data {

namespace {

constexpr char kMagic[8] = {'T', 'W', 'O', 'B', 'P', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;
constexpr std::size_t kHeaderSize = 24;

template <typename T>
T read_le(const unsigned char* p) {
  T value = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(p[i]) << (8 * i);
  return value;
}

template <typename T>
void put_le(std::string& out, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

using twobp::detail::mix64;

}  // namespace

std::vector<uint16_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<uint16_t> tokens(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<uint16_t>& tokens) {
  std::string text(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TWOBP_CHECK(tokens[i] < kVocabSize, UsageError, "ByteTokenizer::decode: token {} at position {} is not a byte",
                tokens[i], i);
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, uint32_t vocab_size) {
  TWOBP_CHECK(vocab_size >= 1 && vocab_size <= 65536, UsageError, "token file {}: vocab_size {} is not in [1, 65536]",
              path, vocab_size);
  std::string bytes(kMagic, sizeof(kMagic));
  put_le<uint32_t>(bytes, kVersion);
  put_le<uint32_t>(bytes, vocab_size);
  put_le<uint64_t>(bytes, tokens.size());
  bytes.reserve(kHeaderSize + 2 * tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TWOBP_CHECK(tokens[i] < vocab_size, UsageError, "token file {}: token {} at index {} is >= vocab_size {}", path,
                tokens[i], i, vocab_size);
    put_le<uint16_t>(bytes, tokens[i]);
  }
  write_file(path, bytes, fmt::format("token file {}", path));
}

HeldOutSplit split_held_out(std::vector<uint16_t> tokens, double fraction, int64_t seq_len, const std::string& source) {
  TWOBP_CHECK(fraction >= 0.0 && fraction < 1.0, UsageError, "held-out fraction {} of {}: expected [0, 1)", fraction,
              source);
  HeldOutSplit out;
  const auto held = static_cast<std::size_t>(static_cast<double>(tokens.size()) * fraction);
  out.held_out.assign(tokens.end() - static_cast<std::ptrdiff_t>(held), tokens.end());
  tokens.resize(tokens.size() - held);
  out.train = std::move(tokens);
  TWOBP_CHECK(fraction == 0.0 || static_cast<int64_t>(out.held_out.size()) > seq_len, UsageError,
              "a held-out fraction {} of {} is {} tokens, fewer than one sequence of {} + 1; raise it or shorten the "
              "sequences", fraction, source, out.held_out.size(), seq_len);
  TWOBP_CHECK(static_cast<int64_t>(out.train.size()) > seq_len, UsageError,
              "{} has {} tokens{}, fewer than one sequence of {} + 1", source, out.train.size(),
              fraction > 0.0 ? " left for training" : "", seq_len);
  return out;
}

std::vector<uint16_t> read_token_file(const std::string& path, uint32_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  TWOBP_CHECK(in.is_open(), IOError, "token file {}: cannot open it for reading", path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TWOBP_CHECK(!in.bad(), IOError, "token file {}: read error", path);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());

  std::size_t offset = 0;
  uint64_t count = 0;
  if (bytes.size() >= sizeof(kMagic) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0) {
    TWOBP_CHECK(bytes.size() >= kHeaderSize, IOError,
                "token file {}: truncated header: {} bytes, the header needs {} (offset {})", path, bytes.size(),
                kHeaderSize, bytes.size());
    const uint32_t version = read_le<uint32_t>(p + 8);
    TWOBP_CHECK(version == kVersion, IOError, "token file {}: unsupported version {} at offset 8 (expected {})", path,
                version, kVersion);
    const uint32_t declared_vocab = read_le<uint32_t>(p + 12);
    TWOBP_CHECK(declared_vocab >= 1 && declared_vocab <= vocab_size, IOError,
                "token file {}: vocab_size {} at offset 12 does not fit the model's vocabulary of {}", path,
                declared_vocab, vocab_size);
    count = read_le<uint64_t>(p + 16);
    const uint64_t available = (bytes.size() - kHeaderSize) / 2;
    TWOBP_CHECK(count <= available && bytes.size() == kHeaderSize + 2 * count, IOError,
                "token file {}: header (offset 16) declares {} tokens = {} bytes, but the file has {} bytes{}", path,
                count, kHeaderSize + 2 * count, bytes.size(),
                bytes.size() < kHeaderSize + 2 * count
                    ? fmt::format(" (truncated at offset {})", bytes.size())
                    : fmt::format(" (trailing data from offset {})", kHeaderSize + 2 * count));
    offset = kHeaderSize;
  } else {
    TWOBP_CHECK(bytes.size() % 2 == 0, IOError,
                "token file {}: no TWOBPTOK header and an odd size of {} bytes: a raw uint16 stream is truncated at "
                "offset {}", path, bytes.size(), bytes.size() - 1);
    count = bytes.size() / 2;
  }
  std::vector<uint16_t> tokens(count);
  for (uint64_t i = 0; i < count; ++i) {
    const uint16_t t = read_le<uint16_t>(p + offset + 2 * i);
    TWOBP_CHECK(t < vocab_size, IOError, "token file {}: token {} at offset {} is >= the vocabulary size {}", path, t,
                offset + 2 * i, vocab_size);
    tokens[i] = t;
  }
  return tokens;
}

BatchSampler::BatchSampler(std::vector<uint16_t> tokens, int64_t seq_len, int64_t batch_size, uint64_t seed)
    : tokens_(std::move(tokens)), seq_len_(seq_len), batch_size_(batch_size), seed_(seed) {
  TWOBP_CHECK(seq_len > 0 && batch_size > 0, UsageError, "BatchSampler: seq_len {} and batch_size {} must be positive",
              seq_len, batch_size);
  TWOBP_CHECK(static_cast<int64_t>(tokens_.size()) >= seq_len + 1, UsageError,
              "BatchSampler: the data has {} tokens, fewer than one window of seq_len + 1 = {}", tokens_.size(),
              seq_len + 1);
}

int64_t warmup_seq_len(int64_t full, int64_t step, int64_t warmup_steps, int64_t multiple) {
  TWOBP_CHECK(full > 0 && multiple > 0, UsageError, "warmup_seq_len: full length {} and multiple {} must be positive",
              full, multiple);
  if (warmup_steps <= 0 || step + 1 >= warmup_steps) return full;
  const int64_t len = full * (step + 1) / warmup_steps / multiple * multiple;
  return std::min(full, std::max(multiple, len));
}

Batch BatchSampler::batch(int64_t step) const {
  const uint64_t windows = tokens_.size() - static_cast<uint64_t>(seq_len_);  // valid start offsets
  at::Tensor window = at::empty({batch_size_, seq_len_ + 1}, at::kLong);
  int64_t* out = window.data_ptr<int64_t>();
  uint64_t state = mix64(seed_ ^ mix64(static_cast<uint64_t>(step)));
  for (int64_t b = 0; b < batch_size_; ++b) {
    state = mix64(state);
    const uint64_t start = state % windows;
    for (int64_t t = 0; t <= seq_len_; ++t) out[b * (seq_len_ + 1) + t] = tokens_[start + t];
  }
  return {window.narrow(1, 0, seq_len_).contiguous(), window.narrow(1, 1, seq_len_).contiguous()};
}

}  // namespace twobp::data
