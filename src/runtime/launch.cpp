// Running the ranks of a job (see twobp/runtime/launch.h).

#include "twobp/runtime/launch.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "twobp/error.h"
#include "twobp/metrics/memory.h"
#include "util/check.h"
#include "util/failure.h"

namespace twobp {
namespace {

/// A rank's error that another rank's failure explains: the TransportError of a peer's abort (or its re-raise with
/// the root cause's type), or a TimeoutError while waiting for a peer that will never come.
bool is_consequence(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const RaisedOnAnotherRank&) {
    return true;
  } catch (const TransportError&) {
    return true;
  } catch (const TimeoutError&) {
    return true;
  } catch (...) {
    return false;
  }
}

/// The abort reason for a rank's error: its rank and type travel to the peers (util/failure.h).
std::string reason_of(int rank, const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return detail::failure_reason(rank, x);
  } catch (...) {
    return fmt::format("rank {} failed: unknown exception", rank);
  }
}

}  // namespace

std::string error_message(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

bool RankErrors::ok() const {
  for (const auto& e : errors) {
    if (e) return false;
  }
  return true;
}

std::exception_ptr RankErrors::root_cause() const {
  std::exception_ptr first;
  for (const auto& e : errors) {
    if (!e) continue;
    if (!is_consequence(e)) return e;
    if (!first) first = e;
  }
  return first;
}

void RankErrors::rethrow_root_cause() const {
  if (std::exception_ptr e = root_cause()) std::rethrow_exception(e);
}

RankErrors run_rank_threads(const std::vector<Transport*>& transports, const RankBody& body, bool abort_on_error) {
  RankErrors result;
  result.errors.resize(transports.size());
  std::vector<std::thread> threads;
  threads.reserve(transports.size());
  for (std::size_t r = 0; r < transports.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        const memory::ScopedAccount account(static_cast<int>(r));  // CPU tensor memory counted per rank
        body(*transports[r]);
      } catch (...) {
        result.errors[r] = std::current_exception();
        if (abort_on_error) transports[r]->abort(reason_of(static_cast<int>(r), result.errors[r]));
      }
    });
  }
  for (auto& t : threads) t.join();
  return result;
}

RankErrors run_rank_threads(const std::vector<std::unique_ptr<Transport>>& transports, const RankBody& body,
                            bool abort_on_error) {
  std::vector<Transport*> raw;
  for (const auto& t : transports) raw.push_back(t.get());
  return run_rank_threads(raw, body, abort_on_error);
}

void run_ranks(const RunRanksOptions& options, const RankBody& body) {
  const std::optional<LaunchEnv> launch = options.launch ? options.launch : launch_env();
  if (launch) {
    std::shared_ptr<Transport> transport = options.process_transport
                                               ? options.process_transport(*launch)
                                               : std::make_shared<StoreTransport>(*launch, options.store);
    TWOBP_CHECK(transport != nullptr, UsageError, "run_ranks: RunRanksOptions::process_transport returned null");
    try {
      body(*transport);
    } catch (...) {
      // Peers fail fast, naming this rank (under MPI the job ends here).
      transport->abort(reason_of(launch->rank, std::current_exception()));
      throw;
    }
    return;
  }
  TWOBP_CHECK(options.thread_ranks >= 1, UsageError, "run_ranks: thread_ranks must be >= 1, got {}",
              options.thread_ranks);
  run_rank_threads(make_local_transports(options.thread_ranks, options.local), body).rethrow_root_cause();
}

void exit_without_teardown(int status) {
  std::cout.flush();
  std::cerr.flush();
  std::clog.flush();
  std::fflush(nullptr);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  std::exit(status);  // LeakSanitizer and ThreadSanitizer report at exit
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  std::exit(status);
#endif
#endif
  std::_Exit(status);
}

}  // namespace twobp
