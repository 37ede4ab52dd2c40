#include "twobp/metrics/op_count.h"

#include <ATen/record_function.h>

#include <time.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "util/check.h"

namespace twobp::metrics {

struct AtenOpCounter::State {
  bool by_name = false;
  clockid_t clock = CLOCK_MONOTONIC;
  std::atomic<std::int64_t> ops{0};
  std::atomic<std::int64_t> inside_ns{0};
  std::mutex mutex;  // by_name: autograd's device threads run operators too
  std::map<std::string, std::int64_t> names;
};

namespace {

// RecordFunction takes plain function pointers: the live counter's state is global (one counter at a time).
std::atomic<AtenOpCounter::State*> g_state{nullptr};
// Operators entered and not yet left on this thread: only a call made at depth 0 is top-level.
thread_local int t_depth = 0;

std::int64_t now_ns(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct TopLevel : at::ObserverContext {
  std::int64_t start_ns = 0;
};

// Records of the dispatcher's operators carry the operator's name; RECORD_FUNCTION scopes (the autograd
// engine's "autograd::engine::evaluate_function: MulBackward0", user ranges) do not: they are transparent, so
// that the operators a backward node calls count as top-level.
bool is_operator(const at::RecordFunction& fn) { return fn.operator_name().has_value(); }

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (!is_operator(fn) || t_depth++ != 0) return nullptr;
  AtenOpCounter::State* state = g_state.load();
  if (state == nullptr) return nullptr;
  auto ctx = std::make_unique<TopLevel>();
  ctx->start_ns = now_ns(state->clock);  // last, so that the callback's own work counts as outside
  return ctx;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (!is_operator(fn)) return;
  --t_depth;  // enter and exit come in pairs: RecordFunction keeps the callbacks it started with
  AtenOpCounter::State* state = g_state.load();
  if (ctx == nullptr || state == nullptr) return;
  const std::int64_t end_ns = now_ns(state->clock);
  state->ops.fetch_add(1);
  state->inside_ns.fetch_add(end_ns - static_cast<TopLevel*>(ctx)->start_ns);
  if (state->by_name) {
    std::lock_guard<std::mutex> lock(state->mutex);
    ++state->names[fn.name()];
  }
}

}  // namespace

AtenOpCounter::AtenOpCounter(AtenOpCounterOptions options) : state_(new State) {
  state_->by_name = options.by_name;
  state_->clock = options.thread_cpu_time ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
  // The cost of one reading (a system call for CPU time, not for the steady clock), to take out of outside_us.
  constexpr int kReadings = 2000;
  const std::int64_t start = now_ns(state_->clock);
  for (int k = 1; k < kReadings; ++k) now_ns(state_->clock);
  reading_us_ = static_cast<double>(now_ns(state_->clock) - start) / kReadings / 1e3;
  State* expected = nullptr;
  if (!g_state.compare_exchange_strong(expected, state_)) {
    delete state_;
    detail::raise<UsageError>("AtenOpCounter: another counter is alive in this process; count one thing at a time");
  }
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(on_enter, on_exit).needsInputs(false).scopes({at::RecordScope::FUNCTION}));
}

AtenOpCounter::~AtenOpCounter() {
  at::removeCallback(handle_);
  g_state.store(nullptr);
  delete state_;
}

AtenOpCounter::Counts AtenOpCounter::take() {
  Counts c;
  c.ops = state_->ops.exchange(0);
  c.inside_us = static_cast<double>(state_->inside_ns.exchange(0)) / 1e3;
  std::lock_guard<std::mutex> lock(state_->mutex);
  c.by_name.swap(state_->names);
  return c;
}

double AtenOpCounter::now_us() const { return static_cast<double>(now_ns(state_->clock)) / 1e3; }

double AtenOpCounter::outside_us(double elapsed_us, const Counts& counts) const {
  return elapsed_us - counts.inside_us - static_cast<double>(counts.ops) * reading_us_;
}

}  // namespace twobp::metrics
