// Code written against twobp 0.2's 16-bit token API still compiles (with deprecation warnings) and means what it
// meant: std::vector<uint16_t> arguments are widened, results convert back to std::vector<uint16_t> -- refusing,
// never truncating, a token that does not fit (CHANGELOG.md, 0.3.0). This file is compiled with the deprecation
// warnings it exists to produce.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "common/temp_files.h"
#include "twobp/data.h"
#include "twobp/error.h"

namespace twobp::testing {
namespace {

TEST(TokenApiCompat02, SixteenBitCallsAreForwarded) {
  const std::string dir = make_temp_dir("token_compat");
  const std::string path = dir + "/old.tok";
  // Every 0.2 spelling: results kept in std::vector<uint16_t>, such vectors passed in.
  const std::vector<uint16_t> encoded = data::ByteTokenizer::encode("old code");
  EXPECT_EQ(data::ByteTokenizer::decode(encoded), "old code");
  std::vector<uint16_t> tokens(300);
  for (std::size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<uint16_t>(k * 200);
  data::write_token_file(path, tokens, 65536);
  EXPECT_EQ(file_size(path), 24 + 2 * 300);  // version 1, as 0.2 wrote it
  const std::vector<uint16_t> read = data::read_token_file(path, 65536);
  EXPECT_EQ(read, tokens);
  const data::HeldOutSplit split = data::split_held_out(tokens, 0.5, 16, "old tokens");
  const std::vector<uint16_t> train = split.train;
  EXPECT_EQ(train, std::vector<uint16_t>(tokens.begin(), tokens.begin() + 150));
  const data::BatchSampler old(tokens, 16, 2, 5), now(data::Tokens(tokens.begin(), tokens.end()), 16, 2, 5);
  EXPECT_TRUE(torch::equal(old.batch(3).inputs, now.batch(3).inputs));
  // A token beyond 16 bits is refused by the conversion, naming it, not truncated.
  const data::Tokens wide{1, 65536};
  try {
    const std::vector<uint16_t> narrow = wide;
    ADD_FAILURE() << "converted " << narrow.size() << " tokens";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("token 65536 at index 1"), std::string::npos) << e.what();
  }
  remove_tree(dir);
}

}  // namespace
}  // namespace twobp::testing
