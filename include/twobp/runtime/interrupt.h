#pragma once
// Ctrl-C (SIGINT) and `kill` (SIGTERM) end a training job between steps instead of in the middle of one, so that
// the program can still write what the finished steps produced (JSON, traces, a checkpoint) and exit with the
// shell's status for the signal (130, 143):
//
//   twobp::InterruptGuard interrupts;                     // from here on the signals are recorded, not fatal
//   for (int step = 0; step < steps; ++step) {
//     pipeline.step(x, y);
//     optimizer.step();
//     if (interrupts.agreed(world, timeout)) break;       // collective: every rank stops after the same step
//   }
//   write_outputs();
//   return interrupts.exit_status();                      // 0, or 128 + the signal
//
// A step is never cut short: a rank that stopped in the middle of one would leave its peers waiting for messages
// until their timeout. A second signal while the first is pending ends the process at once with the default
// action (a job stuck in a step can still be killed). The first signal is acknowledged at once on standard error
// ("interrupt: SIGINT received: finishing step 12 of 150, then writing run.json; ..."): set_announcement() keeps
// the second half current.
//
// Under a launcher (mpirun forwards the signal as SIGTERM and kills the ranks 1-2 s later, whatever they do) a
// program cannot count on finishing its step: it should also write its outputs as it goes (the example's --json
// and the bench's results are rewritten after each step / configuration).

#include <string_view>

#include "twobp/transport/transport.h"

namespace twobp {

/// Records SIGINT and SIGTERM from construction to destruction (the previous handlers are restored then). One at a
/// time per process: constructing a second while one lives throws UsageError. The flag is the process's, so rank
/// threads of one process all see it; agreed() makes the ranks of a job (threads or processes) act on it at the
/// same step.
class InterruptGuard {
 public:
  /// `announce`: print the acknowledgement line on the first signal (programs pass true on one rank only).
  explicit InterruptGuard(bool announce = true);
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  /// The signal this process received (SIGINT, SIGTERM), or 0. Cheap: read it between steps.
  int received() const;

  /// Collective over `transport` (every rank calls it at the same point, e.g. after each step): whether any rank
  /// received a signal, the same answer on every rank. Once true, received() and exit_status() on every rank
  /// report the signal (the largest number, if ranks received different ones).
  bool agreed(Transport& transport, Duration timeout);

  /// What the acknowledgement says will happen, after "interrupt: SIGINT received: " (at most 400 bytes kept;
  /// default "finishing the work in progress"). Call it from one thread (the reporting rank's), e.g. once per step;
  /// the signal handler reads it without a lock (a double buffer).
  void set_announcement(std::string_view what);

  /// "SIGINT" or "SIGTERM" for received(); "" when none was received. For the program's closing line.
  const char* received_name() const;

  /// 128 + received(): the shell's status for a process ended by that signal (130 for SIGINT, 143 for SIGTERM);
  /// 0 when none was received.
  int exit_status() const;
};

}  // namespace twobp
