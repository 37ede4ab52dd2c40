#pragma once
// One report for a stalled job. When a rank's wait times out, its executor asks every rank of the pipeline -- of
// the whole job, by world rank, for the groups of ParallelGroups -- (through the transport's StatusBoard) what it
// is doing, follows who waits on whom, and names the first rank that
// did not act and why -- dead, stuck in compute, outside the step, or a cycle of ranks waiting on each other. The
// report rides in the TimeoutError, and the abort that follows carries it to every other rank, so every rank
// prints the same one.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace twobp {

/// What one rank was doing at the moment the report was asked for.
struct RankStatus {
  enum class State { kOutsideStep, kComputing, kWaiting, kFailed };
  State state = State::kOutsideStep;
  /// The action: "RECV_B stage 2 micro-batch 5" (describe(Action)); empty outside a step or when it waits for
  /// something other than one action (its last sends).
  std::string action;
  int peer = -1;          ///< kWaiting: the rank whose message it waits for; -1: none in particular
  std::int64_t run = -1;  ///< the run (step or evaluation) it is in, or was last in; -1: none yet
  double seconds = 0;     ///< how long it has been in this state
  std::string detail;     ///< kWaiting without an action: for what; kFailed: the error
  /// kWaiting in a collective (peer -1) (`detail` names it, e.g. the data-parallel gradient reduction): the other ranks of
  /// the collective. Those also waiting in it (same detail, same run) have joined; the others are what it waits
  /// for.
  std::vector<int> peers;
};

/// The text form a status travels in over a StatusBoard (JSON), and back; decode gives nullopt for text that is
/// not a status.
std::string encode(const RankStatus& status);
std::optional<RankStatus> decode_rank_status(const std::string& text);

/// The report for `statuses` (index = rank; nullopt = the rank did not answer), as seen by rank `reporter`:
/// the verdict -- which rank did not act and why -- then one line per rank. Follows the wait-for edges (a waiting
/// rank -> the rank whose message it waits for, or each rank of its collective that has not joined it) from every
/// waiting rank: a chain ends at a rank that is not waiting for a peer (that rank is the culprit), or closes into a
/// cycle (a deadlock: the ranks' orders disagree).
std::string hang_report(const std::vector<std::optional<RankStatus>>& statuses, int reporter);

}  // namespace twobp
