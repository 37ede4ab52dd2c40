#pragma once
// Training data for the examples: a byte-level tokenizer, a small built-in corpus, a binary token-file format
// and a deterministic batch sampler.
//
// Token file format (".tok", all integers little-endian). Version 1 stores 16-bit tokens; version 2 says the token
// width in its header, 16 or 32 bits (vocabularies beyond 65536, e.g. Llama 3's 128,256):
//
//   offset  size  field                              offset  size  field (version 2)
//   0       8     magic "TWOBPTOK"                   0       8     magic "TWOBPTOK"
//   8       4     uint32 version = 1                 8       4     uint32 version = 2
//   12      4     uint32 vocab_size (<= 65536)       12      4     uint32 vocab_size
//   16      8     uint64 num_tokens                  16      8     uint64 num_tokens
//   24      2·n   uint16 tokens                      24      4     uint32 token_bits: 16 or 32
//                                                    28      4     uint32 reserved = 0
//                                                    32      b·n   tokens of token_bits / 8 = b bytes each
//
// Every token is < vocab_size. write_token_file writes version 1 when 16 bits suffice (so that twobp 0.2 and any
// tool that reads version 1 still read it) and version 2 with 32-bit tokens otherwise. The header is optional: a
// file that does not start with the magic is read as a bare stream of uint16 tokens (its size must then be even),
// with vocab_size taken from the reader's argument. A file with a header must be exactly header + b·num_tokens
// bytes long. Every violation throws IOError naming the file, the byte offset and what was expected there.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace twobp::data {

/// A token id. 32 bits since twobp 0.3 (16 in 0.2): every vocabulary a token file can declare fits.
using Token = uint32_t;

/// A token stream in memory: a std::vector<Token>. For one release (until 0.4) it also converts, with a deprecation
/// warning, to 0.2's std::vector<uint16_t>, so 0.2 code that kept a result in one still compiles; the conversion
/// throws UsageError naming the first token that does not fit in 16 bits rather than truncating it.
class Tokens : public std::vector<Token> {
 public:
  using std::vector<Token>::vector;
  Tokens() = default;
  Tokens(std::vector<Token> tokens) : std::vector<Token>(std::move(tokens)) {}  // NOLINT(google-explicit-constructor)
  // NOLINTNEXTLINE(google-explicit-constructor)
  [[deprecated("twobp 0.3 tokens are 32-bit: keep them in a data::Tokens (or std::vector<uint32_t>, or auto); "
               "see CHANGELOG.md, 0.3.0")]] operator std::vector<uint16_t>() const;
};

namespace detail {
// Enables the deprecated 0.2 overloads below for std::vector<uint16_t> arguments only. A template, so that a
// braced list ({1, 2, 3}) still picks the Token overload instead of being ambiguous between the two.
template <typename T>
using IfUint16 = std::enable_if_t<std::is_same_v<T, uint16_t>, int>;
}  // namespace detail

/// Byte-level tokenizer: token = byte value, vocabulary 256, lossless for any byte string (UTF-8 included).
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  static Tokens encode(std::string_view text);
  /// Throws UsageError for a token >= 256.
  static std::string decode(const std::vector<Token>& tokens);
  template <typename T, detail::IfUint16<T> = 0>
  [[deprecated("pass 32-bit tokens (data::Tokens); see CHANGELOG.md, 0.3.0")]] static std::string decode(
      const std::vector<T>& tokens) {
    return decode(std::vector<Token>(tokens.begin(), tokens.end()));
  }
};

/// A few KB of English prose written for this repository (no third-party text), for demos and tests.
std::string_view builtin_corpus();

/// The token width write_token_file picks for `vocab_size`: 16 bits when every token fits (vocab_size <= 65536),
/// else 32.
int token_bits_for(uint64_t vocab_size);

/// Writes `tokens` with a header (see above) to `path` via a temporary file and a rename. `token_bits`: 16, 32, or
/// 0 for token_bits_for(vocab_size); 16-bit files are version 1, 32-bit ones version 2. UsageError (naming the file)
/// for a vocab_size of 0, a token >= vocab_size, or a width that is not 0, 16 or 32 or too narrow for the vocabulary;
/// IOError when the file cannot be written.
void write_token_file(const std::string& path, const std::vector<Token>& tokens, uint32_t vocab_size,
                      int token_bits = 0);
template <typename T, detail::IfUint16<T> = 0>
[[deprecated("pass 32-bit tokens (data::Tokens); see CHANGELOG.md, 0.3.0")]] void write_token_file(
    const std::string& path, const std::vector<T>& tokens, uint32_t vocab_size) {
  write_token_file(path, std::vector<Token>(tokens.begin(), tokens.end()), vocab_size);
}

/// Reads and validates a token file of either version and width. `vocab_size` is the model's vocabulary: a header
/// declaring a larger one, or any token >= the header's vocab_size (without a header: >= vocab_size), is an error
/// (IOError naming the file and the byte offset).
Tokens read_token_file(const std::string& path, uint32_t vocab_size);

/// A token stream cut for evaluation: the last `fraction` held out (never trained on), the rest for training.
struct HeldOutSplit {
  Tokens train, held_out;
};
/// `tokens` split at the last `fraction` (in [0, 1); 0: nothing held out). UsageError naming `source` (the
/// corpus, e.g. its file) when a part that should exist has no sequence of `seq_len` + 1 tokens to draw.
HeldOutSplit split_held_out(std::vector<Token> tokens, double fraction, int64_t seq_len, const std::string& source);
template <typename T, detail::IfUint16<T> = 0>
[[deprecated("pass 32-bit tokens (data::Tokens); see CHANGELOG.md, 0.3.0")]] HeldOutSplit split_held_out(
    const std::vector<T>& tokens, double fraction, int64_t seq_len, const std::string& source) {
  return split_held_out(std::vector<Token>(tokens.begin(), tokens.end()), fraction, seq_len, source);
}

/// One batch: inputs and targets [batch, seq] int64, targets shifted by one token.
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

/// Sequence-length warm-up: the length of step `step` (0-based) when training starts short and reaches `full`
/// after `warmup_steps` steps: full * (step + 1) / warmup_steps rounded down to a multiple of `multiple` (at least
/// `multiple`, at most `full`); `full` from step warmup_steps - 1 on, and always when warmup_steps <= 0.
int64_t warmup_seq_len(int64_t full, int64_t step, int64_t warmup_steps, int64_t multiple = 8);

/// Draws [batch, seq + 1] windows at random offsets of a token stream. Stateless: batch(step) depends only on
/// (tokens, seq_len, batch_size, seed, step), so a resumed run sees exactly the batches of an uninterrupted one,
/// and every rank of a pipeline can draw the same batch independently.
class BatchSampler {
 public:
  /// Throws UsageError when the stream is shorter than seq_len + 1 tokens or a size is not positive.
  BatchSampler(std::vector<Token> tokens, int64_t seq_len, int64_t batch_size, uint64_t seed);
  template <typename T, detail::IfUint16<T> = 0>
  [[deprecated("pass 32-bit tokens (data::Tokens); see CHANGELOG.md, 0.3.0")]] BatchSampler(
      const std::vector<T>& tokens, int64_t seq_len, int64_t batch_size, uint64_t seed)
      : BatchSampler(std::vector<Token>(tokens.begin(), tokens.end()), seq_len, batch_size, seed) {}

  Batch batch(int64_t step) const;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t seq_len() const { return seq_len_; }
  int64_t batch_size() const { return batch_size_; }

 private:
  std::vector<Token> tokens_;
  int64_t seq_len_;
  int64_t batch_size_;
  uint64_t seed_;
};

}  // namespace twobp::data
