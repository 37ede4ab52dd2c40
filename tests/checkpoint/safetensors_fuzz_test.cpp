// Random damage to a valid safetensors file -- truncations, bit flips, a rewritten header length, inserted bytes,
// digits and JSON punctuation changed in the header -- must give a UsageError or a file whose every tensor reads
// back as exactly the bytes the header's offsets point at: never a crash, never another exception, never a byte
// from outside the file's data buffer. Deterministic (seeded); the sanitize build runs it under ASan + UBSan.
// tests/fuzz/safetensors_target.cpp is the same contract for libFuzzer.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <fstream>
#include <random>
#include <string>
#include <typeinfo>

#include "common/temp_files.h"
#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"

namespace twobp::testing {
namespace safetensors_fuzz {

namespace ck = twobp::checkpoint;

std::string valid_file() {
  torch::manual_seed(11);
  return ck::safetensors_bytes({{"model.embed.weight", torch::randn({4, 3})},
                                {"layers.0.bias", torch::randn({3}, torch::kDouble)},
                                {"half", torch::randn({2, 2}).to(torch::kBFloat16)},
                                {"ids", torch::arange(5, torch::kLong)},
                                {"flags", torch::tensor({true, false, true})},
                                {"scalar", torch::tensor(1.0)},
                                {"empty", torch::zeros({0, 2})}},
                               {{"format", "pt"}});
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return n;
}

// One random change; most of them aimed at the header, where the parser is.
void mutate(std::string& b, std::mt19937_64& rng) {
  const auto pick = [&](std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng() % n); };
  const std::size_t header_end = b.size() >= 8 ? std::min<uint64_t>(b.size(), 8 + header_length(b)) : b.size();
  switch (rng() % 7) {
    case 0:  // truncate
      b.resize(pick(b.size()));
      break;
    case 1:  // flip a bit anywhere
      if (!b.empty()) b[pick(b.size())] ^= static_cast<char>(1u << (rng() % 8));
      break;
    case 2:  // flip a bit in the header
      if (header_end > 0) b[pick(header_end)] ^= static_cast<char>(1u << (rng() % 8));
      break;
    case 3: {  // a new header length: near the real one, or anything
      if (b.size() < 8) break;
      const uint64_t n = rng() % 2 ? header_length(b) + pick(33) - 16 : rng();
      for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((n >> (8 * i)) & 0xff);
      break;
    }
    case 4:  // insert a byte
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), static_cast<char>(rng()));
      break;
    case 5:  // a digit of the header changed (shapes, offsets)
      for (int tries = 0; tries < 64 && header_end > 8; ++tries) {
        char& c = b[8 + pick(header_end - 8)];
        if (c >= '0' && c <= '9') {
          c = static_cast<char>('0' + rng() % 10);
          break;
        }
      }
      break;
    default: {  // JSON punctuation dropped in
      static const char kChars[] = "{}[]:,\"0-e. ";
      if (header_end > 8) b[8 + pick(header_end - 8)] = kChars[rng() % (sizeof(kChars) - 1)];
      break;
    }
  }
}

// Opens and reads `bytes` (as the file at `path`): true when it reads, false when refused with a UsageError.
bool read_back(const std::string& path, const std::string& bytes) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    const ck::SafetensorsFile f(path);
    const uint64_t data_start = 8 + header_length(bytes);
    for (const ck::SafetensorsEntry& e : f.entries()) {
      // What the reader returns is exactly the file's bytes at the header's offsets, inside the file.
      EXPECT_LE(data_start + e.end, bytes.size()) << e.name;
      EXPECT_EQ(std::string(f.bytes(e.name)), bytes.substr(data_start + e.begin, e.nbytes())) << e.name;
      try {
        const at::Tensor t = f.read(e.name);
        EXPECT_EQ(static_cast<uint64_t>(t.numel()) * t.element_size(), e.nbytes()) << e.name;
      } catch (const UsageError&) {
        EXPECT_EQ(e.dtype, at::kBool) << "only a BOOL byte other than 0/1 is refused on read: " << e.name;
      }
    }
    return true;
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << "the error names the file: " << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
    return false;
  }
}

TEST(SafetensorsFuzz, DamagedFilesAreRefusedOrReadExactly) {
  const std::string dir = make_temp_dir("safetensors_fuzz");
  const std::string path = dir + "/damaged.safetensors";
  const std::string valid = valid_file();
  ASSERT_TRUE(read_back(path, valid));
  std::mt19937_64 rng(20240607);
  int accepted = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string bytes = valid;
    const int changes = 1 + static_cast<int>(rng() % 3);
    for (int c = 0; c < changes; ++c) mutate(bytes, rng);
    try {
      (read_back(path, bytes) ? accepted : refused)++;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << ": " << typeid(e).name() << ": " << e.what();
    }
  }
  remove_tree(dir);
  std::printf("safetensors fuzz: %d damaged files read, %d refused\n", accepted, refused);
  // Both outcomes occur: damage to the data buffer keeps a file valid, damage to the header mostly does not.
  EXPECT_GT(accepted, 20);
  EXPECT_GT(refused, 1000);
}

}  // namespace safetensors_fuzz
}  // namespace twobp::testing
