#include "twobp/version.h"

#include <fmt/format.h>
#include <torch/headeronly/version.h>

#include "twobp/config.h"
#include "twobp_commit.h"  // generated at build time by cmake/TwobpCommit.cmake: TWOBP_BUILD_COMMIT

namespace twobp {

BuildInfo build_info() {
  BuildInfo info;
  info.version = TWOBP_VERSION_STRING;
  info.commit = TWOBP_BUILD_COMMIT;
  info.torch_version = fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  info.mpi = TWOBP_HAVE_MPI;
  info.nccl = TWOBP_HAVE_NCCL;
  return info;
}

std::string version_line(std::string_view program) {
  const BuildInfo info = build_info();
  return fmt::format("{} (twobp {}, commit {}, torch {}{}{})", program, info.version, info.commit,
                     info.torch_version, info.mpi ? ", MPI" : "", info.nccl ? ", NCCL" : "");
}

}  // namespace twobp
