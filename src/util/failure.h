#pragma once
// How a rank's failure travels to its peers: the reason it aborts the transports with names its rank and the
// error's type ("rank 3 failed (NumericalError): ..."), and a peer that gets the resulting TransportError re-raises
// it with that type (PeerError<NumericalError>), so every rank of the job reports the root cause's type.

#include <exception>
#include <string>

namespace twobp::detail {

/// "rank R failed (Type): what()": the reason given to Transport::abort for an error raised on `rank`; with `where`
/// (the action it was raised in, for an error that cannot carry it itself) "... what() (in where)".
std::string failure_reason(int rank, const std::exception& e, const std::string& where = "");

/// `text` with " (in where)" appended when `where` is not empty: how an error that cannot carry its place itself
/// is told with it (failure_reason, the status board).
std::string placed(std::string text, const std::string& where);

/// For a TransportError whose message carries a failure_reason() of a twobp error type: that error as
/// PeerError<Type> with the same message; null for anything else (including errors already re-raised).
std::exception_ptr as_root_type(const std::exception& e);

}  // namespace twobp::detail
