#pragma once
// Seed mixing, written once: the library's deterministic generators (model initialisation, batch sampling, stage
// random streams) derive their seeds with it.

#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace twobp::detail {

/// splitmix64's finaliser: a well-spread 64-bit value from any 64-bit input.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// A seed for a key of several integers, order-sensitive: mix64 folded over them.
inline uint64_t mix_key(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0;
  for (uint64_t p : parts) h = mix64(h ^ p);
  return h;
}

/// FNV-1a of a string: the part of a seed that a name (a parameter's) contributes.
inline uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace twobp::detail
