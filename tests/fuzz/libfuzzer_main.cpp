// libFuzzer entry point; TWOBP_FUZZ_TARGET (set by CMake) is the function of fuzz_targets.h it drives.

#include "fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return twobp::fuzz::TWOBP_FUZZ_TARGET(data, size);
}
