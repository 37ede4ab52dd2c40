#include "twobp/data.h"

#include <ATen/ATen.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "twobp/files.h"
#include "util/hash.h"
#include "util/check.h"

namespace twobp::data {

namespace {

constexpr char kMagic[8] = {'T', 'W', 'O', 'B', 'P', 'T', 'O', 'K'};
constexpr std::size_t kHeaderV1 = 24;  // magic, version, vocab_size, num_tokens; 16-bit tokens follow
constexpr std::size_t kHeaderV2 = 32;  // ... then token_bits and a reserved word; tokens of token_bits follow

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

// Where a file's tokens are and how they are stored, from its header (or its absence).
struct Layout {
  std::size_t offset = 0;  // of the first token
  std::size_t width = 2;   // bytes per token
  uint64_t count = 0;
  uint32_t vocab = 0;      // every token is below it: the header's vocab_size, else the model's
  const char* vocab_source = "the model's";
};

// The layout a file's header declares, checked against the file's size and the model's vocabulary. A version-1
// header, or none, means 16-bit tokens.
Layout parse_header(const std::string& path, const std::string& bytes, uint32_t vocab_size) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  Layout l;
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    TWOBP_CHECK(bytes.size() % 2 == 0, IOError,
                "token file {}: no TWOBPTOK header and an odd size of {} bytes: a raw uint16 stream is truncated at "
                "offset {}", path, bytes.size(), bytes.size() - 1);
    l.count = bytes.size() / 2;
    l.vocab = vocab_size;
    return l;
  }
  TWOBP_CHECK(bytes.size() >= 12, IOError,
              "token file {}: truncated header: {} bytes, the version needs 12 (offset {})", path, bytes.size(),
              bytes.size());
  const uint32_t version = read_le<uint32_t>(p + 8);
  TWOBP_CHECK(version == 1 || version == 2, IOError,
              "token file {}: unsupported version {} at offset 8 (expected 1 or 2)", path, version);
  const std::size_t header = version == 1 ? kHeaderV1 : kHeaderV2;
  TWOBP_CHECK(bytes.size() >= header, IOError,
              "token file {}: truncated header: {} bytes, a version {} header needs {} (offset {})", path,
              bytes.size(), version, header, bytes.size());
  const uint32_t declared_vocab = read_le<uint32_t>(p + 12);
  TWOBP_CHECK(declared_vocab >= 1 && declared_vocab <= vocab_size, IOError,
              "token file {}: vocab_size {} at offset 12 does not fit the model's vocabulary of {}", path,
              declared_vocab, vocab_size);
  if (version == 2) {
    const uint32_t bits = read_le<uint32_t>(p + 24);
    TWOBP_CHECK(bits == 16 || bits == 32, IOError,
                "token file {}: token width {} bits at offset 24 (expected 16 or 32)", path, bits);
    const uint32_t reserved = read_le<uint32_t>(p + 28);
    TWOBP_CHECK(reserved == 0, IOError, "token file {}: reserved field {} at offset 28 (expected 0)", path, reserved);
    TWOBP_CHECK(bits == 32 || declared_vocab <= 65536, IOError,
                "token file {}: vocab_size {} at offset 12 does not fit the 16-bit tokens it declares at offset 24",
                path, declared_vocab);
    l.width = bits / 8;
  } else {
    TWOBP_CHECK(declared_vocab <= 65536, IOError,
                "token file {}: vocab_size {} at offset 12 does not fit the 16-bit tokens of version 1 (at most 65536)",
                path, declared_vocab);
  }
  l.offset = header;
  l.count = read_le<uint64_t>(p + 16);
  l.vocab = declared_vocab;
  l.vocab_source = "the header's";
  const uint64_t available = (bytes.size() - header) / l.width;
  if (l.count <= available && bytes.size() == header + l.width * l.count) return l;
  // The size the header asks for, unless it is beyond any file (a count near 2^64 would overflow it).
  const bool huge = l.count > (std::numeric_limits<uint64_t>::max() - header) / l.width;
  twobp::detail::raise<IOError>(
      "token file {}: header (offset 16) declares {} tokens of {} bits = {} bytes, but the file has {} bytes{}", path,
      l.count, 8 * l.width, huge ? std::string("more than 2^64") : std::to_string(header + l.width * l.count),
      bytes.size(),
      l.count > available ? fmt::format(" (truncated at offset {})", bytes.size())
                          : fmt::format(" (trailing data from offset {})", header + l.width * l.count));
}

}  // namespace

Tokens::operator std::vector<uint16_t>() const {
  std::vector<uint16_t> narrow(size());
  for (std::size_t i = 0; i < size(); ++i) {
    TWOBP_CHECK((*this)[i] <= 0xffff, UsageError,
                "data::Tokens: token {} at index {} does not fit the std::vector<uint16_t> of twobp 0.2; keep the "
                "tokens in a data::Tokens", (*this)[i], i);
    narrow[i] = static_cast<uint16_t>((*this)[i]);
  }
  return narrow;
}

Tokens ByteTokenizer::encode(std::string_view text) {
  Tokens tokens(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<Token>& tokens) {
  std::string text(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TWOBP_CHECK(tokens[i] < kVocabSize, UsageError, "ByteTokenizer::decode: token {} at position {} is not a byte",
                tokens[i], i);
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

int token_bits_for(uint64_t vocab_size) { return vocab_size <= 65536 ? 16 : 32; }

void write_token_file(const std::string& path, const std::vector<Token>& tokens, uint32_t vocab_size,
                      int token_bits) {
  TWOBP_CHECK(vocab_size >= 1, UsageError, "token file {}: vocab_size 0 (expected at least 1)", path);
  TWOBP_CHECK(token_bits == 0 || token_bits == 16 || token_bits == 32, UsageError,
              "token file {}: token width {} bits (expected 16, 32, or 0 for the vocabulary's)", path, token_bits);
  const int bits = token_bits == 0 ? token_bits_for(vocab_size) : token_bits;
  TWOBP_CHECK(bits == 32 || vocab_size <= 65536, UsageError,
              "token file {}: vocab_size {} needs 32-bit tokens (16 bits hold at most 65536)", path, vocab_size);
  std::string bytes(kMagic, sizeof(kMagic));
  put_le<uint32_t>(bytes, bits == 16 ? 1 : 2);  // version 1 when it can be: twobp 0.2 reads it too
  put_le<uint32_t>(bytes, vocab_size);
  put_le<uint64_t>(bytes, tokens.size());
  if (bits == 32) {
    put_le<uint32_t>(bytes, 32);
    put_le<uint32_t>(bytes, 0);
  }
  bytes.reserve(bytes.size() + bits / 8 * tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TWOBP_CHECK(tokens[i] < vocab_size, UsageError, "token file {}: token {} at index {} is >= vocab_size {}", path,
                tokens[i], i, vocab_size);
    if (bits == 16) {
      put_le<uint16_t>(bytes, static_cast<uint16_t>(tokens[i]));
    } else {
      put_le<uint32_t>(bytes, tokens[i]);
    }
  }
  write_file(path, bytes, fmt::format("token file {}", path));
}

HeldOutSplit split_held_out(std::vector<Token> tokens, double fraction, int64_t seq_len, const std::string& source) {
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

Tokens read_token_file(const std::string& path, uint32_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  TWOBP_CHECK(in.is_open(), IOError, "token file {}: cannot open it for reading", path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TWOBP_CHECK(!in.bad(), IOError, "token file {}: read error", path);
  const Layout l = parse_header(path, bytes, vocab_size);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data()) + l.offset;
  Tokens tokens(l.count);
  for (uint64_t i = 0; i < l.count; ++i) {
    const Token t = l.width == 2 ? read_le<uint16_t>(p + 2 * i) : read_le<uint32_t>(p + 4 * i);
    TWOBP_CHECK(t < l.vocab, IOError, "token file {}: token {} at offset {} is >= the vocabulary size {} ({})", path,
                t, l.offset + l.width * i, l.vocab, l.vocab_source);
    tokens[i] = t;
  }
  return tokens;
}

BatchSampler::BatchSampler(std::vector<Token> tokens, int64_t seq_len, int64_t batch_size, uint64_t seed)
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
