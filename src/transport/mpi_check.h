#pragma once
// Private MPI helpers: the return-code check every MPI call goes through, and polling a request with a
// deadline (MPI has no timed wait). Only included by files built when MPI was found.

#include <mpi.h>

#include <string>

#include "transport/common.h"
#include "util/check.h"

namespace twobp::detail {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<std::size_t>(length));
}

[[noreturn]] inline void raise_mpi_error(int code, const char* call, const char* file, int line) {
  raise<TransportError>("{} failed at {}:{}: {} (MPI error code {})", call, file, line, mpi_error_string(code),
                        code);
}

}  // namespace twobp::detail

/// Runs an MPI call and throws TransportError with the MPI error string and file:line when it fails. Only
/// meaningful on communicators with MPI_ERRORS_RETURN (the default MPI_ERRORS_ARE_FATAL never returns).
#define TWOBP_MPI_CHECK(call)                                                  \
  do {                                                                         \
    const int twobp_mpi_rc_ = (call);                                          \
    if (twobp_mpi_rc_ != MPI_SUCCESS) {                                        \
      ::twobp::detail::raise_mpi_error(twobp_mpi_rc_, #call, __FILE__, __LINE__); \
    }                                                                          \
  } while (false)
