// Tokenizer, built-in corpus, token-file reader validation and the batch sampler.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "common/temp_files.h"
#include "twobp/data.h"
#include "twobp/error.h"

namespace td = twobp::data;

namespace {


using twobp::testing::file_exists;
using twobp::testing::file_size;
using twobp::testing::make_temp_dir;
using twobp::testing::remove_tree;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Expects IOError whose message names the file and contains `needle`.
template <typename F>
void expect_io_error(F&& f, const std::string& file, const std::string& needle) {
  try {
    f();
    FAIL() << "expected IOError for " << file;
  } catch (const twobp::IOError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(file), std::string::npos) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
}

}  // namespace

TEST(ByteTokenizer, RoundTrip) {
  const std::string text = "Hello, pipeline! \xc3\xa9t\xc3\xa9 \x01\xff";
  const auto tokens = td::ByteTokenizer::encode(text);
  ASSERT_EQ(tokens.size(), text.size());
  for (auto t : tokens) EXPECT_LT(t, 256);
  EXPECT_EQ(td::ByteTokenizer::decode(tokens), text);
  EXPECT_THROW(td::ByteTokenizer::decode({65, 256}), twobp::UsageError);
}

TEST(Corpus, IsSmallAsciiProse) {
  const auto corpus = td::builtin_corpus();
  EXPECT_GT(corpus.size(), 4000u);
  EXPECT_LT(corpus.size(), 64u * 1024u);
  for (char c : corpus) EXPECT_TRUE(c == '\n' || (c >= 32 && c < 127)) << static_cast<int>(c);
  EXPECT_EQ(td::ByteTokenizer::decode(td::ByteTokenizer::encode(corpus)), corpus);
}

TEST(TokenFile, RoundTripWithHeaderAndRaw) {
  const std::string dir = make_temp_dir("data_test");
  const auto path = dir + "/corpus.tok";
  const auto tokens = td::ByteTokenizer::encode(td::builtin_corpus());
  td::write_token_file(path, tokens, 256);
  EXPECT_EQ(file_size(path), 24 + 2 * tokens.size());
  EXPECT_EQ(td::read_token_file(path, 256), tokens);
  // Raw stream: no header, little-endian uint16.
  const auto raw = dir + "/raw.bin";
  write_bytes(raw, std::string("\x41\x00\x42\x00\x00\x01", 6));
  EXPECT_EQ(td::read_token_file(raw, 300), (td::Tokens{0x41, 0x42, 0x100}));
  remove_tree(dir);
}

// Vocabularies beyond 16 bits (Llama 3's 128,256): version 2 with 32-bit tokens, chosen by the vocabulary or asked
// for; a 16-bit vocabulary still writes version 1, byte for byte what twobp 0.2 wrote.
TEST(TokenFile, ThirtyTwoBitTokensRoundTrip) {
  const std::string dir = make_temp_dir("data_test");
  const td::Tokens wide{0, 1, 65535, 65536, 100000, 128255};
  const auto path = dir + "/wide.tok";
  td::write_token_file(path, wide, 128256);
  const std::string bytes = slurp(path);
  ASSERT_EQ(bytes.size(), 32 + 4 * wide.size());
  EXPECT_EQ(bytes.substr(0, 12), std::string("TWOBPTOK\x02\0\0\0", 12));  // version 2
  EXPECT_EQ(bytes.substr(24, 8), std::string("\x20\0\0\0\0\0\0\0", 8));  // 32 bits, reserved 0
  EXPECT_EQ(bytes.substr(32 + 4 * 3, 4), std::string("\0\0\x01\0", 4));    // 65536, little-endian
  EXPECT_EQ(td::read_token_file(path, 128256), wide);
  EXPECT_EQ(td::read_token_file(path, 200000), wide);  // a model with a larger vocabulary reads it too

  // 32 bits asked for with a small vocabulary; 16 bits for a vocabulary of exactly 65536.
  td::write_token_file(path, {7, 255}, 256, 32);
  EXPECT_EQ(file_size(path), 32 + 4 * 2);
  EXPECT_EQ(td::read_token_file(path, 256), (td::Tokens{7, 255}));
  td::write_token_file(path, {65535}, 65536);
  EXPECT_EQ(file_size(path), 24 + 2);
  EXPECT_EQ(slurp(path).substr(8, 4), std::string("\x01\0\0\0", 4));  // version 1
  EXPECT_EQ(td::token_bits_for(65536), 16);
  EXPECT_EQ(td::token_bits_for(65537), 32);

  // A version-2 header may declare 16-bit tokens (other writers); the reader takes them.
  std::string v2_16("TWOBPTOK\x02\0\0\0\x00\x01\0\0\x02\0\0\0\0\0\0\0\x10\0\0\0\0\0\0\0", 32);
  write_bytes(path, v2_16 + std::string("\x05\0\xff\0", 4));
  EXPECT_EQ(td::read_token_file(path, 256), (td::Tokens{5, 255}));

  // What the writer refuses, naming the file.
  const auto refused = [&](auto write, const std::string& needle) {
    try {
      write();
      ADD_FAILURE() << "no UsageError for " << needle;
    } catch (const twobp::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&] { td::write_token_file(path, {1}, 70000, 16); }, "vocab_size 70000 needs 32-bit tokens");
  refused([&] { td::write_token_file(path, {1}, 256, 24); }, "token width 24 bits");
  refused([&] { td::write_token_file(path, {1, 70000}, 70000); }, "token 70000 at index 1");
  refused([&] { td::write_token_file(path, {}, 0); }, "vocab_size 0");
  remove_tree(dir);
}

// Bad version-2 files: one IOError naming the file, the offset and what was expected there.
TEST(TokenFile, MalformedWideFilesNameFileAndOffset) {
  const std::string dir = make_temp_dir("data_test");
  const auto good = dir + "/good.tok";
  td::write_token_file(good, {1, 2, 70000, 4}, 70001);  // 32 + 16 bytes
  const std::string bytes = slurp(good);
  ASSERT_EQ(bytes.size(), 48u);
  const auto bad = [&](const std::string& name, const std::string& content, uint32_t vocab,
                       const std::string& needle) {
    const auto path = dir + "/" + name;
    write_bytes(path, content);
    expect_io_error([&] { td::read_token_file(path, vocab); }, path, needle);
  };
  std::string width = bytes;
  width[24] = 24;
  bad("width.tok", width, 70001, "token width 24 bits at offset 24 (expected 16 or 32)");
  width[24] = 0;
  bad("width0.tok", width, 70001, "token width 0 bits at offset 24");
  std::string reserved = bytes;
  reserved[29] = 1;
  bad("reserved.tok", reserved, 70001, "reserved field 256 at offset 28 (expected 0)");
  bad("truncated.tok", bytes.substr(0, bytes.size() - 1), 70001, "truncated at offset 47");
  bad("trailing.tok", bytes + "xy", 70001, "trailing data from offset 48");
  bad("short_header.tok", bytes.substr(0, 28), 70001, "a version 2 header needs 32 (offset 28)");
  EXPECT_EQ(td::read_token_file(good, 70001), (td::Tokens{1, 2, 70000, 4}));  // the control for what follows
  bad("small_model.tok", bytes, 65536, "vocab_size 70001 at offset 12 does not fit the model's vocabulary of 65536");
  std::string big = bytes;
  big[32 + 4 * 3 + 2] = 0x10;  // token 3 becomes 0x100004
  bad("big.tok", big, 1u << 22, "token 1048580 at offset 44 is >= the vocabulary size 70001 (the header's)");
  std::string sixteen = bytes;  // declares 16-bit tokens with a vocabulary they cannot hold
  sixteen[24] = 16;
  bad("narrow.tok", sixteen, 70001, "vocab_size 70001 at offset 12 does not fit the 16-bit tokens");
  std::string v1 = bytes.substr(0, 24) + std::string(8, '\0');  // version 1 declaring vocab 70001
  v1[8] = 1;
  bad("v1_wide_vocab.tok", v1, 70001, "does not fit the 16-bit tokens of version 1");
  std::string v3 = bytes;
  v3[8] = 3;
  bad("version3.tok", v3, 70001, "unsupported version 3 at offset 8 (expected 1 or 2)");
  remove_tree(dir);
}

TEST(TokenFile, MalformedFilesNameFileAndOffset) {
  const std::string dir = make_temp_dir("data_test");
  const auto good = dir + "/good.tok";
  td::write_token_file(good, {1, 2, 3, 4}, 256);
  const std::string bytes = slurp(good);

  const auto truncated = dir + "/truncated.tok";
  write_bytes(truncated, bytes.substr(0, bytes.size() - 3));
  expect_io_error([&] { td::read_token_file(truncated, 256); }, truncated, "truncated at offset 29");

  const auto short_header = dir + "/short_header.tok";
  write_bytes(short_header, bytes.substr(0, 12));
  expect_io_error([&] { td::read_token_file(short_header, 256); }, short_header, "offset 12");

  const auto trailing = dir + "/trailing.tok";
  write_bytes(trailing, bytes + "xy");
  expect_io_error([&] { td::read_token_file(trailing, 256); }, trailing, "trailing data from offset 32");

  const auto odd = dir + "/odd.bin";
  write_bytes(odd, "abc");
  expect_io_error([&] { td::read_token_file(odd, 256); }, odd, "offset 2");

  auto bad_token = bytes;
  bad_token[24 + 2 * 2 + 1] = 0x01;  // token 2 becomes 0x0103 = 259
  const auto big = dir + "/big.tok";
  write_bytes(big, bad_token);
  expect_io_error([&] { td::read_token_file(big, 256); }, big, "at offset 28");

  auto bad_version = bytes;
  bad_version[8] = 9;
  const auto version = dir + "/version.tok";
  write_bytes(version, bad_version);
  expect_io_error([&] { td::read_token_file(version, 256); }, version, "version 9");

  // A header declaring a larger vocabulary than the model's.
  expect_io_error([&] { td::read_token_file(good, 128); }, good, "vocab_size 256");

  const auto missing = dir + "/missing.tok";
  expect_io_error([&] { td::read_token_file(missing, 256); }, missing, "cannot open");
  remove_tree(dir);
}

// The held-out split keeps every token once, in order, the tail held out; a part too short for one sequence of
// seq_len + 1 tokens is refused naming the corpus (the held-out part only when one is asked for).
TEST(HeldOutSplit, TheTailIsHeldOutAndEachPartHoldsASequence) {
  td::Tokens tokens(1000);
  for (std::size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<td::Token>(k % 300);
  for (double fraction : {0.0, 0.1, 0.25, 0.5}) {
    const td::HeldOutSplit split = td::split_held_out(tokens, fraction, 16, "corpus");
    EXPECT_EQ(split.held_out.size(), static_cast<std::size_t>(1000 * fraction)) << fraction;
    td::Tokens joined = split.train;
    joined.insert(joined.end(), split.held_out.begin(), split.held_out.end());
    EXPECT_EQ(joined, tokens) << fraction;
  }
  auto expect_refused = [&](double fraction, int64_t seq_len, const std::string& what) {
    try {
      td::split_held_out(tokens, fraction, seq_len, "my.tokens");
      ADD_FAILURE() << "no error for fraction " << fraction << " seq_len " << seq_len;
    } catch (const twobp::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("my.tokens"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_refused(0.01, 16, "held-out fraction 0.01");  // 10 tokens held out
  expect_refused(0.0, 1000, "has 1000 tokens");        // nothing held out, too short to train on
  expect_refused(0.5, 600, "held-out fraction 0.5");
  expect_refused(0.9, 120, "left for training");       // 100 tokens left for training
  expect_refused(1.0, 1, "expected [0, 1)");
  expect_refused(-0.1, 1, "expected [0, 1)");
}

TEST(BatchSampler, DeterministicShiftedWindows) {
  auto tokens = td::ByteTokenizer::encode(td::builtin_corpus());
  td::BatchSampler a(tokens, 16, 4, 123), b(tokens, 16, 4, 123), c(tokens, 16, 4, 124);
  auto b0 = a.batch(0);
  EXPECT_EQ(b0.inputs.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(b0.targets.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(b0.inputs.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(b0.inputs.narrow(1, 1, 15), b0.targets.narrow(1, 0, 15)));
  EXPECT_TRUE(torch::equal(b0.inputs, b.batch(0).inputs));
  EXPECT_TRUE(torch::equal(a.batch(5).targets, b.batch(5).targets));
  EXPECT_FALSE(torch::equal(b0.inputs, a.batch(1).inputs));
  EXPECT_FALSE(torch::equal(b0.inputs, c.batch(0).inputs));
  // The window is a real slice of the stream.
  const auto row = b0.inputs[0];
  const std::string text(td::builtin_corpus());
  std::string window;
  for (int64_t i = 0; i < 16; ++i) window.push_back(static_cast<char>(row[i].item<int64_t>()));
  EXPECT_NE(text.find(window), std::string::npos);
  EXPECT_THROW(td::BatchSampler(td::Tokens(10, 1), 10, 1, 0), twobp::UsageError);
}

TEST(WarmupSeqLen, GrowsInMultiplesToTheFullLength) {
  using twobp::data::warmup_seq_len;
  EXPECT_EQ(warmup_seq_len(64, 0, 4), 16);
  EXPECT_EQ(warmup_seq_len(64, 1, 4), 32);
  EXPECT_EQ(warmup_seq_len(64, 2, 4), 48);
  EXPECT_EQ(warmup_seq_len(64, 3, 4), 64);
  EXPECT_EQ(warmup_seq_len(64, 100, 4), 64);
  EXPECT_EQ(warmup_seq_len(64, 0, 100), 8);  // never below one multiple
  EXPECT_EQ(warmup_seq_len(5, 0, 100), 5);   // nor above the full length
  EXPECT_EQ(warmup_seq_len(64, 0, 0), 64);   // no warm-up
  EXPECT_THROW(warmup_seq_len(0, 0, 4), twobp::UsageError);
}
