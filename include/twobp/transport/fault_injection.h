#pragma once
// A transport that wraps another and injects the faults a cluster produces into its point-to-point sends, for
// testing what a job does with them: it must either finish with the results of a fault-free run, or end on every
// rank within its timeout with an error naming rank, peer and the message -- never hang.
//
//   kDelay      every chosen send waits `delay` before it starts          -> same results, later
//   kDrop       a chosen send is never delivered (its wait() succeeds)     -> the receiver times out naming it
//   kFailSend   a chosen send fails: its wait() throws TransportError      -> the sender fails naming the message
//   kDie        after `after_messages` sends the rank dies: it aborts its   -> every peer fails fast naming it
//               transport (as a killed rank's peers see) and throws
//   kDuplicate  a chosen send is delivered twice                           -> same results (by-tag pairing: the copy
//                                                                             is never matched), or every rank fails
//                                                                             naming both tags (in-order pairing)
//   kCorrupt    a chosen send delivers a copy with one bit flipped: the    -> a different result, unless the pipeline
//               sign of one element (drawn from the seed)                   verifies messages (verify_messages): then
//                                                                           every rank fails naming the message
//   kReorder    a chosen send is held back `delay` on a thread of its own  -> same results
//               while later sends overtake it -- any later send on by-tag
//               pairing, those on other channels on in-order pairing (later
//               sends on its channel queue behind it: all the contract allows)
//
// Which sends are chosen: those of `ranks` (empty: every rank) to `peer` (-1: any) whose label contains
// `label_contains` (e.g. "SEND_B"; empty: any), skipping the first `after_messages` of them (kDie: the count before
// dying), at most `max_faults` of them, each then with `probability`, drawn from a generator seeded by (seed, rank)
// so that a run is repeatable.
// Collectives (all-reduce, broadcast, barrier, split, reduce-scatter, all-gather, and the async forms) are passed
// through untouched (fault_contract_probe runs the sharded ones in every cell: a fault in the messages must leave
// them exact); groups split from it inject the same faults, named by their group ranks.

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "twobp/transport/wrapping.h"

namespace twobp {

enum class Fault { kDelay, kDrop, kFailSend, kDie, kDuplicate, kReorder, kCorrupt };

/// The fault's name ("delay", "drop", "fail-send", "die", "duplicate", "reorder", "corrupt").
const char* to_string(Fault fault);

struct FaultOptions {
  Fault fault = Fault::kDelay;
  std::vector<int> ranks;          ///< faulty senders; empty: every rank
  int peer = -1;                   ///< only sends to this rank; -1: to any
  std::string label_contains;      ///< only sends whose label contains this; empty: any
  int after_messages = 0;          ///< chosen sends let through first (kDie: sends before the rank dies)
  double probability = 1.0;        ///< of each chosen send after those, in [0, 1]
  int max_faults = -1;             ///< at most this many faults on this rank; -1: no limit
  uint64_t seed = 0;               ///< with the rank, seeds the draw
  Duration delay = Duration(20);   ///< kDelay, kReorder
};

/// UsageError unless `options` can inject anything in a world of `world_size` ranks: probability in [0, 1];
/// after_messages and delay >= 0; max_faults >= -1; peer in -1 .. world_size - 1; every one of `ranks` in
/// 0 .. world_size - 1.
void check_fault_options(const FaultOptions& options, int world_size);

class FaultInjectingTransport final : public WrappingTransport {
 public:
  /// Wraps `inner` (shared with the caller or owned). UsageError for options out of range (check_fault_options
  /// against inner's world size): a fault test must not pass because nothing was injected.
  FaultInjectingTransport(std::shared_ptr<Transport> inner, FaultOptions options);

  std::string name() const override;
  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override;

  /// Sends this rank made through it, and how many of them were given the fault.
  int64_t sends() const { return sends_; }
  int64_t faults() const { return faults_; }

 private:
  struct Split {};  // a group split from a checked one: its options are taken as they are
  FaultInjectingTransport(std::shared_ptr<Transport> inner, FaultOptions options, Split);
  bool chosen(const P2POptions& options);

  FaultOptions options_;
  std::mt19937_64 random_;
  int64_t sends_ = 0, eligible_ = 0, faults_ = 0;
  bool dead_ = false;
  // kReorder on in-order pairing: per (peer, channel), the held send that later sends on it must queue behind.
  std::map<std::pair<int, int>, std::shared_future<std::shared_ptr<Work>>> held_;
};

}  // namespace twobp
