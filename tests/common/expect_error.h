#pragma once
// Asserting on twobp's errors: the type, and the words the message must contain (rank, stage, what to do).

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "twobp/error.h"

namespace twobp::testing {

/// Runs `f`, which must throw E whose what() contains every one of `words`.
template <typename E = UsageError>
void expect_error(const std::function<void()>& f, const std::vector<std::string>& words) {
  try {
    f();
    FAIL() << "expected an exception";
  } catch (const E& e) {
    const std::string what = e.what();
    for (const auto& w : words) EXPECT_NE(what.find(w), std::string::npos) << "'" << w << "' not in: " << what;
  }
}

}  // namespace twobp::testing
