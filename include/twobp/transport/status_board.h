#pragma once
// Where the ranks of one transport group tell each other what they are doing when the job stops making progress.
// The runtime's hang report (twobp/runtime/hang_report.h) is built from it; the board only moves short texts and
// knows nothing of schedules.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "twobp/transport/transport.h"

namespace twobp {

class StatusBoard {
 public:
  using Reader = std::function<std::string()>;
  virtual ~StatusBoard() = default;

  /// Registers how to read `rank`'s current status. A reader is called from any thread, at any time until
  /// detach(rank) returned, and must be cheap and thread-safe; it must not call the board.
  virtual void attach(int rank, Reader reader) = 0;
  virtual void detach(int rank) = 0;

  /// The status of every rank of the group (index = rank; a group's view of its world's board, as ParallelGroups'
  /// groups have, answers for every world rank, index = Transport::world_rank_of), `rank`'s own included; nullopt for a rank that did not
  /// answer within `wait` (dead, or busy where it cannot answer); "" for one that answered without a reader.
  /// `incident` names the asking (the asker's run number), so answers to an earlier stall are never mixed in.
  /// Threads of one process (Local): every attached reader is read at once, whatever its rank is doing. Processes
  /// (Store, MPI): the others are asked, and each process answers from a watcher thread started by its first
  /// attach(), whatever its rank is doing; a dead process never answers.
  virtual std::vector<std::optional<std::string>> collect(int rank, std::int64_t incident, Duration wait) = 0;

  /// The report of `incident`: the first one a rank offers wins and is returned to it and to every later caller,
  /// so that ranks whose waits time out at the same moment still report one text (MPI: the caller's own, since
  /// the abort that follows ends the whole job). Every rank passes the same number for the same stall: the
  /// earliest run that a rank answering collect() is in (ranks waiting after run N and in run N + 1 agree).
  virtual std::string agree_on_report(std::int64_t incident, const std::string& report) = 0;
};

/// The in-process board of ranks that are threads of one process (the Local transport's).
std::shared_ptr<StatusBoard> make_in_process_status_board(int world_size);

}  // namespace twobp
