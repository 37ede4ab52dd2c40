#pragma once
// Training data for the examples: a byte-level tokenizer, a small built-in corpus, a binary token-file format
// and a deterministic batch sampler.
//
// Token file format (".tok", all integers little-endian):
//
//   offset  size  field
//   0       8     magic "TWOBPTOK"
//   8       4     uint32 version = 1
//   12      4     uint32 vocab_size (every token must be < vocab_size; at most 65536)
//   16      8     uint64 num_tokens
//   24      2·n   uint16 tokens
//
// The header is optional: a file that does not start with the magic is read as a bare stream of uint16 tokens
// (its size must then be even), with vocab_size taken from the reader's argument. A file with the header must be
// exactly 24 + 2·num_tokens bytes long. Every violation throws IOError naming the file and the byte offset.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace twobp::data {

/// Byte-level tokenizer: token = byte value, vocabulary 256, lossless for any byte string (UTF-8 included).
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  static std::vector<uint16_t> encode(std::string_view text);
  /// Throws UsageError for a token >= 256.
  static std::string decode(const std::vector<uint16_t>& tokens);
};

/// A few KB of English prose written for this repository (no third-party text), for demos and tests.
std::string_view builtin_corpus();

/// Writes `tokens` with the header (see above) to `path` via a temporary file and a rename. Throws IOError.
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, uint32_t vocab_size);

/// Reads and validates a token file. `vocab_size` is the model's vocabulary: a header declaring a larger one, or
/// any token >= vocab_size, is an error (IOError naming the file and the token's byte offset).
std::vector<uint16_t> read_token_file(const std::string& path, uint32_t vocab_size);

/// A token stream cut for evaluation: the last `fraction` held out (never trained on), the rest for training.
struct HeldOutSplit {
  std::vector<uint16_t> train, held_out;
};
/// `tokens` split at the last `fraction` (in [0, 1); 0: nothing held out). UsageError naming `source` (the
/// corpus, e.g. its file) when a part that should exist has no sequence of `seq_len` + 1 tokens to draw.
HeldOutSplit split_held_out(std::vector<uint16_t> tokens, double fraction, int64_t seq_len, const std::string& source);

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
  BatchSampler(std::vector<uint16_t> tokens, int64_t seq_len, int64_t batch_size, uint64_t seed);

  Batch batch(int64_t step) const;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t seq_len() const { return seq_len_; }
  int64_t batch_size() const { return batch_size_; }

 private:
  std::vector<uint16_t> tokens_;
  int64_t seq_len_;
  int64_t batch_size_;
  uint64_t seed_;
};

}  // namespace twobp::data
