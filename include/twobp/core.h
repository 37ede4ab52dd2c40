#pragma once
// Umbrella header of the core, twobp::core: what a program links to run a pipeline -- the 2BP split (autograd, nn,
// stage), schedules as data (generators, the synthesizer, text, validate, simulate), the runtime (Pipeline,
// Executor, run_ranks, data parallelism), transports, traces and metrics. It needs only LibTorch; MpiEnvironment and
// MpiTransport need twobp::mpi (find_package(twobp COMPONENTS MPI)), NcclTransport twobp::nccl (COMPONENTS NCCL).
// The core never includes the kit (twobp/kit.h): the tier_wall test checks it (docs/ARCHITECTURE.md).
//
// Every public header of the core is listed here, every one of the kit in twobp/kit.h (install_umbrella_header
// checks both against include/twobp/ and cmake/TwobpTiers.cmake).

#include "twobp/config.h"

#include "twobp/error.h"
#include "twobp/files.h"
#include "twobp/version.h"

#include "twobp/autograd/weight_grad_store.h"
#include "twobp/nn.h"
#include "twobp/nn/functional.h"
#include "twobp/nn/modules.h"
#include "twobp/precision.h"
#include "twobp/random.h"
#include "twobp/stage.h"
#include "twobp/tensors.h"

#include "twobp/schedule/action.h"
#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/messages.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/synthesize.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"

#include "twobp/metrics/energy.h"
#include "twobp/metrics/memory.h"
#include "twobp/metrics/metrics.h"
#include "twobp/metrics/op_count.h"
#include "twobp/metrics/units.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/executor.h"
#include "twobp/runtime/hang_report.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/mpi_launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/runtime/training_state.h"
#include "twobp/trace/attribution.h"
#include "twobp/trace/trace.h"

#include "twobp/transport/checksum.h"
#include "twobp/transport/collectives.h"
#include "twobp/transport/fault_injection.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/local.h"
#include "twobp/transport/pairing.h"
#include "twobp/transport/status_board.h"
#include "twobp/transport/store.h"
#include "twobp/transport/transport.h"
#include "twobp/transport/wrapping.h"
// mpi.h in every build: launched_by_mpi_launcher() is part of the core; MpiEnvironment and MpiTransport are
// declared only when twobp was built with MPI (TWOBP_HAVE_MPI).
#include "twobp/transport/mpi.h"
#if TWOBP_HAVE_NCCL
#include "twobp/transport/nccl.h"
#endif
