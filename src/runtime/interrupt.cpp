// SIGINT/SIGTERM recorded between steps (see twobp/runtime/interrupt.h).

#include "twobp/runtime/interrupt.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>

#include <atomic>

#include "twobp/error.h"
#include "twobp/transport/collectives.h"
#include "util/check.h"

namespace twobp {
namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM};

// The handler may only touch lock-free atomics and write(2) (async-signal-safe): the signal received, whether a
// guard lives, and the announcement -- two buffers, the one `g_current` names complete (set_announcement writes
// the other, then flips).
std::atomic<int> g_received{0};
std::atomic<bool> g_guarded{false};
std::atomic<bool> g_announce{true};
constexpr std::size_t kAnnouncementBytes = 400;
char g_announcement[2][kAnnouncementBytes + 1];
std::atomic<int> g_current{0};
struct sigaction g_previous[2];

void write_stderr(const char* text) {
  std::size_t n = 0;  // strlen by hand: only write(2) and plain memory reads are async-signal-safe for certain
  while (text[n] != '\0') ++n;
  if (::write(STDERR_FILENO, text, n) < 0) return;  // nothing to do about a closed stderr
}

extern "C" void record_signal(int signal) {
  int none = 0;
  if (g_received.compare_exchange_strong(none, signal)) {
    if (!g_announce.load()) return;
    write_stderr(signal == SIGINT ? "interrupt: SIGINT received: " : "interrupt: SIGTERM received: ");
    write_stderr(g_announcement[g_current.load()]);
    write_stderr(" (a second signal ends the process now)\n");
    return;
  }
  // A second signal while the first is pending: the default action, now (the job may be stuck in a step).
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(signal, &fallback, nullptr);
  ::raise(signal);
}

}  // namespace

InterruptGuard::InterruptGuard(bool announce) {
  TWOBP_CHECK(!g_guarded.exchange(true), UsageError,
              "InterruptGuard: one guard per process at a time (another one lives), since signal handlers are the "
              "process's");
  g_received = 0;
  g_announce = announce;
  set_announcement("finishing the work in progress");
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

void InterruptGuard::set_announcement(std::string_view what) {
  const int next = 1 - g_current.load();
  const std::size_t n = std::min(what.size(), kAnnouncementBytes);
  std::memcpy(g_announcement[next], what.data(), n);
  g_announcement[next][n] = '\0';
  g_current = next;
}

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
