#pragma once
// File helpers for tests. Plain POSIX calls: std::filesystem is avoided because libtorch.so exports its own copies
// of some std::filesystem functions, which interpose on the standard library's (seen crashing in remove_all).

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace twobp::testing {

/// A new, empty directory /tmp/twobp_<tag>_XXXXXX.
inline std::string make_temp_dir(const std::string& tag) {
  std::string templ = "/tmp/twobp_" + tag + "_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + templ);
  return templ;
}

inline void remove_tree(const std::string& dir) {
  ::nftw(dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

inline bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

inline int64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

}  // namespace twobp::testing
