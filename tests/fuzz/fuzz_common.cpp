#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_targets.h"

namespace twobp::fuzz {
namespace {
std::string& current_input() {
  static std::string name;
  return name;
}
}  // namespace

void set_current_input(std::string name) { current_input() = std::move(name); }

void finding(const std::string& what) {
  if (current_input().empty()) {
    std::fprintf(stderr, "twobp fuzz finding: %s\n", what.c_str());
  } else {
    std::fprintf(stderr, "twobp fuzz finding in %s: %s\n", current_input().c_str(), what.c_str());
  }
  std::fflush(stderr);
  std::abort();
}

}  // namespace twobp::fuzz
