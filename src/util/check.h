#pragma once
// Private helpers for raising twobp errors with formatted context. Library code never calls exit() or abort():
// it throws, and the caller (ultimately Pipeline::step) decides how to propagate the failure to the other ranks.

#include <fmt/format.h>

#include <utility>

#include "twobp/error.h"

namespace twobp::detail {

template <typename E, typename... Args>
[[noreturn]] void raise(fmt::format_string<Args...> format, Args&&... args) {
  throw E(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace twobp::detail

/// Throws `type` with a formatted message when `cond` is false. The message must say what was expected and
/// what was found; the caller adds rank/stage/micro-batch context it has.
#define TWOBP_CHECK(cond, type, ...)                \
  do {                                              \
    if (!(cond)) {                                  \
      ::twobp::detail::raise<type>(__VA_ARGS__);    \
    }                                               \
  } while (false)
