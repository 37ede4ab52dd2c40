#pragma once
// How much of a parameter grid a test runs. scripts/sanitize.sh sets TWOBP_TEST_SCALE=reduced: under the sanitizers
// every case costs several times more, and the plain build has already run the full grids. A reduced grid keeps
// every kind of case (each schedule, mode, pairing, option) and drops repetitions (some of the shapes).

#include <cstdlib>
#include <string_view>

namespace twobp::testing {

/// True when TWOBP_TEST_SCALE is "reduced".
inline bool reduced_scale() {
  const char* scale = std::getenv("TWOBP_TEST_SCALE");
  return scale != nullptr && std::string_view(scale) == "reduced";
}

}  // namespace twobp::testing
