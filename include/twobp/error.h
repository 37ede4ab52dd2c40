#pragma once
// Error types of twobp. Every error the library raises derives from twobp::Error, so a training loop can catch
// one type; the subclasses say who is at fault (the caller, a peer, the clock), which decides whether a retry,
// a restart or a bug report is the right reaction.

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

}  // namespace twobp
