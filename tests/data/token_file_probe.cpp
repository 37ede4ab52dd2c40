// token_file_probe FILE VOCAB: reads FILE with twobp::data::read_token_file (the reader of llama_pipeline --data)
// for a model of vocabulary VOCAB and prints "N tokens:" and the tokens on one line; on an error, the error's
// message on standard error and exit status 1. Used by tests/data/tokens_script_test.py to check what
// scripts/tokens.py writes against the C++ reader.

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "twobp/data.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: token_file_probe FILE VOCAB\n");
    return 2;
  }
  try {
    const auto vocab = static_cast<uint32_t>(std::stoul(argv[2]));
    const twobp::data::Tokens tokens = twobp::data::read_token_file(argv[1], vocab);
    std::printf("%zu tokens:", tokens.size());
    for (const twobp::data::Token t : tokens) std::printf(" %u", static_cast<unsigned>(t));
    std::printf("\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "token_file_probe: error: %s\n", e.what());
    return 1;
  }
}
