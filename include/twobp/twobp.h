#pragma once
// Umbrella header: the whole public API of twobp, core and kit (docs/ARCHITECTURE.md). Link twobp::twobp (both
// archives); a program that needs only the runtime may include twobp/core.h and link twobp::core alone.
// MpiEnvironment/MpiTransport need twobp::mpi (find_package(twobp COMPONENTS MPI)), NcclTransport needs twobp::nccl
// (COMPONENTS NCCL). Including a header costs nothing at link time: only the classes a program uses must be linked.

#include "twobp/core.h"
#include "twobp/kit.h"
