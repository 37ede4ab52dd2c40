// The pairing rule of each transport, written once (see twobp/transport/pairing.h).

#include "twobp/transport/pairing.h"

#include "util/check.h"

namespace twobp {

const char* to_string(Pairing pairing) {
  switch (pairing) {
    case Pairing::kByTag:
      return "by-tag";
    case Pairing::kInOrderPerChannel:
      return "in-order-per-channel";
  }
  return "?";
}

Pairing pairing_of(std::string_view transport) {
  // MPI matches by (communicator, source, tag) with the non-overtaking rule; the Local mailbox is keyed the same
  // way. NCCL's ncclSend/ncclRecv carry no tag: a communicator pairs them in posting order.
  if (transport == "local" || transport == "mpi" || transport == "store") return Pairing::kByTag;
  if (transport == "local-in-order" || transport == "nccl") return Pairing::kInOrderPerChannel;
  detail::raise<UsageError>("unknown transport '{}': expected local, local-in-order, mpi, store or nccl", transport);
}

}  // namespace twobp
