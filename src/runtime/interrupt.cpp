// SIGINT/SIGTERM recorded between steps (see twobp/runtime/interrupt.h).

#include "twobp/runtime/interrupt.h"

#include <csignal>

#include <atomic>

#include "twobp/error.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"

namespace twobp {
namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM};

// The handler may only touch lock-free atomics (async-signal-safe): the signal received, and whether a guard lives.
std::atomic<int> g_received{0};
std::atomic<bool> g_guarded{false};
struct sigaction g_previous[2];

extern "C" void record_signal(int signal) {
  int none = 0;
  if (g_received.compare_exchange_strong(none, signal)) return;
  // A second signal while the first is pending: the default action, now (the job may be stuck in a step).
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(signal, &fallback, nullptr);
  ::raise(signal);
}

}  // namespace

InterruptGuard::InterruptGuard() {
  TWOBP_CHECK(!g_guarded.exchange(true), UsageError,
              "InterruptGuard: one guard per process at a time (another one lives), since signal handlers are the "
              "process's");
  g_received = 0;
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // the step's blocking calls go on; the flag is read between steps
  for (int k = 0; k < 2; ++k) ::sigaction(kSignals[k], &action, &g_previous[k]);
}

InterruptGuard::~InterruptGuard() {
  for (int k = 0; k < 2; ++k) ::sigaction(kSignals[k], &g_previous[k], nullptr);
  g_guarded = false;
}

int InterruptGuard::received() const { return g_received.load(); }

bool InterruptGuard::agreed(Transport& transport, Duration timeout) {
  const int signal = static_cast<int>(max_over_ranks(transport, static_cast<double>(received()), timeout));
  if (signal == 0) return false;
  g_received = signal;  // a rank that received none (another process) reports the job's
  return true;
}

const char* InterruptGuard::received_name() const {
  switch (received()) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "";
  }
}

int InterruptGuard::exit_status() const { return received() == 0 ? 0 : 128 + received(); }

}  // namespace twobp
