#pragma once
// Running the ranks of a job, written once for the example, the benchmark and the tests.
//
//   twobp::RunRanksOptions o;
//   o.thread_ranks = 4;                          // when no launcher started this process
//   twobp::run_ranks(o, [&](twobp::Transport& t) { /* build this rank's Pipeline on t, train */ });
//
// Under torchrun, srun or mpirun (twobp::launch_env(), transport/launch.h) this process is one rank: the body runs
// once on the transport o.process_transport makes (default: a StoreTransport meeting at MASTER_ADDR:MASTER_PORT).
// Otherwise o.thread_ranks ranks run as threads over a group of Local transports. MPI lives in the twobp::mpi
// component, which the core does not call: a program that links it passes mpi_process_transport()
// (twobp/runtime/mpi_launch.h, header-only) as o.process_transport.
//
// Errors: a rank whose body throws aborts its transport, so that its peers fail fast with a TransportError naming it
// instead of waiting for their timeout; run_ranks then rethrows the root cause (RankErrors::root_cause). Nothing here
// calls exit(): under MPI, MpiTransport::abort ends the job, as MPI requires -- except exit_without_teardown(), which
// a program calls last.

#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "twobp/transport/launch.h"
#include "twobp/transport/local.h"
#include "twobp/transport/store.h"
#include "twobp/transport/transport.h"

namespace twobp {

/// The body of one rank: everything it does, on its transport (rank(), world_size()).
using RankBody = std::function<void(Transport&)>;

/// Makes this process's transport when a launcher started it, from what the launcher set.
using ProcessTransportFactory = std::function<std::shared_ptr<Transport>(const LaunchEnv&)>;

struct RunRanksOptions {
  /// Ranks run as threads of this process when no launcher started it (ignored under a launcher).
  int thread_ranks = 1;
  /// Options of the Local transports of thread ranks.
  LocalOptions local;
  /// Options of the default process transport (StoreTransport), under a launcher.
  StoreOptions store;
  /// Replaces the StoreTransport under a launcher: MPI (mpi_process_transport), NCCL over a store, ...
  ProcessTransportFactory process_transport;
  /// Who this process is under a launcher; nullopt: launch_env(). A program that knows better (an MpiEnvironment's
  /// rank and size) may set it; thread ranks run only when this and launch_env() are both empty.
  std::optional<LaunchEnv> launch;
};

/// The message of an error: what() of a std::exception, "unknown exception" otherwise, "" for null.
std::string error_message(const std::exception_ptr& e);

/// The error of each rank, by rank (null: the rank's body returned).
struct RankErrors {
  std::vector<std::exception_ptr> errors;

  /// True when no rank failed.
  bool ok() const;
  /// The root cause: the first error, in rank order, that is not a consequence of another rank's failure (a
  /// TransportError, as raised by a peer's abort, or a TimeoutError); when all are, the first of them; null when no
  /// rank failed.
  std::exception_ptr root_cause() const;
  /// Rethrows root_cause() when there is one.
  void rethrow_root_cause() const;
};

/// Runs body(*transports[r]) on one thread per transport and joins them all. With abort_on_error, a rank whose
/// body throws aborts its transport with the error's message (its peers then fail fast). Never throws the bodies'
/// errors: it returns them, for tests that look at every rank's. Thread r's CPU tensor memory is counted in
/// memory account r (twobp/metrics/memory.h).
RankErrors run_rank_threads(const std::vector<Transport*>& transports, const RankBody& body,
                            bool abort_on_error = true);
/// The same on transports owned by the caller (make_local_transports()).
RankErrors run_rank_threads(const std::vector<std::unique_ptr<Transport>>& transports, const RankBody& body,
                            bool abort_on_error = true);

/// Runs the job's ranks (see the top of this file) and rethrows the root cause when a rank failed. Under a launcher
/// a failing body aborts the process's transport (under MPI: the job) before its error is rethrown.
void run_ranks(const RunRanksOptions& options, const RankBody& body);

/// Ends the process with `status`, skipping the destructors of static objects: LibTorch's deregister each of its
/// thousands of operators, ~0.2 s of every process (a third of a CPU-only start and exit: docs/PERFORMANCE.md), paid by each
/// short run -- a usage error, a test, a rank of a small job. Flushes C stdio and the C++ standard streams first.
/// Call it last in main(), once everything that writes or finalizes (files, checkpoints, transports, MPI) was
/// destroyed: `int main(int argc, char** argv) { twobp::exit_without_teardown(run(argc, argv)); }`. In a build
/// with AddressSanitizer or ThreadSanitizer it exits normally (std::exit), so that their checks at exit still run.
[[noreturn]] void exit_without_teardown(int status);

}  // namespace twobp
