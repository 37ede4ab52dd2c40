#pragma once
// How a transport pairs a receive with a send: part of every Transport's contract, and a property the schedule
// validator checks (validate(schedule, pairing)). Kept free of LibTorch so that the schedule module can use it.

#include <cstdint>
#include <string>
#include <string_view>

namespace twobp {

enum class Pairing : std::uint8_t {
  /// A receive gets the message with its (source, destination, tag); messages with equal keys arrive in the
  /// order they were sent. Any posting order of differently tagged messages works (LocalTransport's default,
  /// MpiTransport).
  kByTag,
  /// Tags are ignored: on each channel -- (source, destination, P2POptions::channel) -- the n-th receive posted
  /// by the destination gets the n-th send posted by the source. Two messages of the same shape posted in
  /// different orders on the two sides are silently swapped, so schedules must be checked against it before
  /// they run (NcclTransport, and LocalTransport with LocalOptions::pairing set to this value).
  kInOrderPerChannel,
};

/// Channels a transport that pays for each one creates per link unless told otherwise (NcclOptions::channels: a
/// communicator per link and channel); transports for which channels are free accept any. The pipeline's protocol
/// needs kNumMessageChannels of them (twobp/schedule/messages.h checks that it fits).
constexpr int kDefaultChannelsPerLink = 4;

/// "by-tag" or "in-order-per-channel".
const char* to_string(Pairing pairing);

/// How the transport named `transport` pairs messages: "local" and "mpi" by tag, "local-in-order" and "nccl" in
/// order per channel. The one place this fact is written: the transports' pairing() and the benchmarks'
/// `check-schedules --transport` read it here. Throws UsageError for an unknown name.
Pairing pairing_of(std::string_view transport);

}  // namespace twobp
