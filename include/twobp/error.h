#pragma once
// Error types of twobp. Every error the library raises derives from twobp::Error, so a training loop can catch
// one type; the subclasses say who is at fault (the caller, a peer, the clock), which decides whether a retry,
// a restart or a bug report is the right reaction.
//
// LibTorch's own errors raised inside a pipeline action (c10::Error and its subclasses: a dtype mismatch in the
// chunk's code, c10::OutOfMemoryError) are not wrapped: they keep their type and carry the action as context
// ("... (in rank 1: W stage 3 micro-batches 0,1)"); the rank's peers get a TransportError quoting that message.

#include <stdexcept>
#include <string>

namespace twobp {

/// Base of every exception thrown by twobp. what() always carries the context the library knew: rank, stage,
/// micro-batch and the expectation that was violated.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The caller broke a documented contract: wrong call order (W before I), a tensor of the wrong shape or dtype,
/// an invalid option. Retrying the same call fails the same way.
class UsageError : public Error {
 public:
  using Error::Error;
};

/// A schedule (generated, loaded from text or written by a user) is malformed or would deadlock.
class ScheduleError : public UsageError {
 public:
  using UsageError::UsageError;
};

/// A blocking wait exceeded its timeout. The peer is slow, dead, or never posted the matching operation.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// Communication failed: the transport reported an error, or a peer rank failed and aborted the job.
class TransportError : public Error {
 public:
  using Error::Error;
};

/// A non-finite loss or gradient was found where the user asked the library to stop on it.
class NumericalError : public Error {
 public:
  using Error::Error;
};

/// Reading or writing a checkpoint or data file failed, or its contents do not match what was expected.
class IOError : public Error {
 public:
  using Error::Error;
};

/// Mixed into an error that a rank raises because ANOTHER rank failed first and aborted the job's transports:
/// Pipeline::step re-raises the peer's abort with the root cause's type (PeerError<NumericalError> for a peer's
/// non-finite gradient, ...), so that every rank reports the same type; what() names the rank that raised it and
/// its message. Catch the type as usual; test for this base to tell a consequence from the cause.
class RaisedOnAnotherRank {
 public:
  explicit RaisedOnAnotherRank(int root_rank) : root_rank_(root_rank) {}
  virtual ~RaisedOnAnotherRank() = default;
  /// The rank that raised the original error (numbered in the transport through which it aborted).
  int root_rank() const { return root_rank_; }

 private:
  int root_rank_;
};

/// E (a twobp error type) raised on this rank for another rank's failure; see RaisedOnAnotherRank.
template <class E>
class PeerError final : public E, public RaisedOnAnotherRank {
 public:
  PeerError(const std::string& what, int root_rank) : E(what), RaisedOnAnotherRank(root_rank) {}
};

}  // namespace twobp
