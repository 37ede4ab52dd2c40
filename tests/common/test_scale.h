#pragma once
// How much of a parameter grid a test runs. scripts/sanitize.sh sets TWOBP_TEST_SCALE=reduced: under the sanitizers
// every case costs several times more, and the plain build has already run the full grids. A reduced grid keeps
// every kind of case (each schedule, mode, pairing, option) and drops repetitions (some of the shapes).

#include <cstddef>
#include <cstdlib>
#include <string_view>

namespace twobp::testing {

/// True when TWOBP_TEST_SCALE is "reduced".
inline bool reduced_scale() {
  const char* scale = std::getenv("TWOBP_TEST_SCALE");
  return scale != nullptr && std::string_view(scale) == "reduced";
}

/// The rule of every reduced grid: a case whose grid indices (schedule, mode, shape, ...) sum to an even number runs
/// at either scale, an odd one only at full scale. Alternating over neighbouring indices keeps every value of each
/// dimension while dropping half of the combinations.
inline bool runs_at_this_scale(std::size_t index_sum) { return !reduced_scale() || index_sum % 2 == 0; }

}  // namespace twobp::testing
