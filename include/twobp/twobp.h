#pragma once
// Umbrella header: the whole public API of twobp. Link twobp::twobp; MpiEnvironment/MpiTransport need
// twobp::mpi (find_package(twobp COMPONENTS MPI)), NcclTransport needs twobp::nccl (COMPONENTS NCCL).
// Including a header costs nothing at link time: only the classes a program uses must be linked.
//
// Every public header is listed here (tests/install/check_umbrella.cmake checks it against include/twobp/).

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
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"

#include "twobp/metrics/energy.h"
#include "twobp/metrics/memory.h"
#include "twobp/metrics/metrics.h"
#include "twobp/metrics/op_count.h"
#include "twobp/metrics/step_log.h"
#include "twobp/metrics/units.h"
#include "twobp/plan/choose.h"
#include "twobp/plan/cost_source.h"
#include "twobp/plan/llama.h"
#include "twobp/plan/llama_memory.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/placement.h"
#include "twobp/plan/record.h"
#include "twobp/plan/stage_timer.h"
#include "twobp/plan/step_meter.h"
#include "twobp/plan/synthesize.h"
#include "twobp/plan/trials.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/executor.h"
#include "twobp/runtime/hang_report.h"
#include "twobp/runtime/interrupt.h"
#include "twobp/runtime/job.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/lr_schedule.h"
#include "twobp/runtime/mpi_launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/runtime/sharded_optimizer.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/trace/attribution.h"
#include "twobp/trace/chart.h"
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

#include "twobp/checkpoint.h"
#include "twobp/data.h"
#include "twobp/models/bert.h"
#include "twobp/models/llama.h"
#include "twobp/models/llama_rank.h"
#include "twobp/models/resnet.h"
