#pragma once
// The MpiEnvironment created by mpi_test_main.cpp, for tests that need ranks or a transport.

#include "twobp/transport/mpi.h"

namespace twobp::mpitest {
extern MpiEnvironment* g_mpi;
}
