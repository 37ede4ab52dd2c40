#pragma once
// What this build of twobp is: its version, the commit it was built from and the LibTorch it was compiled
// against, for --version lines and bug reports.

#include <string>
#include <string_view>

namespace twobp {

struct BuildInfo {
  std::string version;        ///< TWOBP_VERSION_STRING (twobp/config.h)
  std::string commit;         ///< the git commit the library was built from, "+dirty" when the tree had local
                              ///< changes; "unknown" when built outside a git checkout
  std::string torch_version;  ///< the LibTorch the library was compiled against (major.minor.patch)
  bool mpi = false;           ///< twobp::mpi built (TWOBP_HAVE_MPI)
  bool nccl = false;          ///< twobp::nccl built (TWOBP_HAVE_NCCL)
};

/// This build's facts (of the library linked, not of the headers a program was compiled with).
BuildInfo build_info();

/// One line for a program's --version: "<program> (twobp 0.3.0, commit 1a2b3c4d5e6f, torch 2.11.0, MPI, NCCL)".
std::string version_line(std::string_view program);

}  // namespace twobp
