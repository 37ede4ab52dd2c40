#pragma once
// run_ranks over MPI: header-only, so that only programs linking twobp::mpi (where MpiTransport lives) compile it;
// the core library never calls MPI. Empty in a build without MPI (TWOBP_HAVE_MPI == 0), so that a program may include
// it unconditionally and guard only its calls.

#include "twobp/config.h"

#if TWOBP_HAVE_MPI

#include <memory>

#include "twobp/runtime/launch.h"
#include "twobp/transport/mpi.h"

namespace twobp {

/// A RunRanksOptions::process_transport that makes an MpiTransport on `env` (which must outlive run_ranks).
inline ProcessTransportFactory mpi_process_transport(const MpiEnvironment& env) {
  return [&env](const LaunchEnv&) -> std::shared_ptr<Transport> { return std::make_shared<MpiTransport>(env); };
}

/// Who this process is, as MPI says (for RunRanksOptions::launch).
inline LaunchEnv mpi_launch_env(const MpiEnvironment& env) {
  LaunchEnv l;
  l.launcher = "mpi";
  l.rank = env.rank();
  l.world_size = env.world_size();
  l.local_rank = env.local_rank();
  l.local_size = env.local_size();
  return l;
}

}  // namespace twobp

#endif  // TWOBP_HAVE_MPI
