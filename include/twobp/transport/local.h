#pragma once
// LocalTransport: the ranks of a pipeline are threads of one process. It is the workhorse of the test suite
// and of single-process runs: every rank gets its own Transport, all of them share one mailbox.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "twobp/transport/transport.h"

namespace twobp {

struct LocalOptions {
  /// false (default): isend copies the tensor into the mailbox and completes at once (an eager, buffered
  /// send). true: a send completes only once the receiver has posted the matching irecv, as with NCCL and
  /// large MPI messages. Use true to check that a schedule does not rely on buffered sends to make progress.
  bool synchronous_sends = false;
  /// kByTag (default): messages are matched by (source, destination, tag). kInOrderPerChannel: matched like NCCL,
  /// in posting order per (source, destination, P2POptions::channel), tags ignored for matching -- but where NCCL
  /// would silently deliver a wrong message, wait() raises UsageError naming both operations (their tags differ).
  /// Run the CPU tests in this mode to catch schedules and callers that only work when messages carry tags.
  Pairing pairing = Pairing::kByTag;
  /// Device of each rank's tensors (device(), where a Pipeline allocates receive buffers): empty = CPU for every
  /// rank, one entry = the same device for all ranks, else one entry per rank. Several ranks may share a GPU.
  std::vector<c10::Device> devices;
};

namespace detail {
struct LocalGroupState;
/// How the last rank to arrive at a Local collective makes its result from the contributions (in rank order).
enum class LocalCombine { kNothing, kSum, kRoot, kConcat };
}  // namespace detail

/// One rank of a LocalTransportGroup.
///
/// Threading: each LocalTransport is used by one thread (its rank's); different ranks run concurrently. All
/// shared state is guarded by one mutex, the waits use condition variables with deadlines.
///
/// Semantics:
///  - isend clones the tensor into the mailbox keyed by (src, dst, tag) -- (src, dst, channel) with in-order
///    pairing --, so the sender may reuse its buffer as
///    soon as isend returned (the Transport contract still says: after wait()). Messages with equal keys are
///    delivered in the order they were sent.
///  - irecv is matched against the mailbox when posted or when the message arrives; wait() copies the message
///    into the buffer after checking shape and dtype (UsageError naming both ranks, the label, expected and
///    actual shape/dtype). Destroying an unfinished receive Work withdraws the posted receive.
///  - Device tensors (ranks as threads sharing GPUs, each thread on its own CUDA stream): isend clones on the
///    sender's current stream and records an event there; the receiver's current stream waits for that event
///    before copying into the buffer, and the payload's memory is marked in use on the receiver's stream, so no
///    stream reads data before it was written or after it was freed. No host synchronisation.
///  - abort(reason) on any rank makes every pending and future wait, all_reduce_sum and barrier on all ranks
///    throw TransportError naming the aborting rank and its reason.
///  - all_reduce_sum sums in rank order (0, 1, ...), so results are bitwise reproducible. all_reduce_sum and
///    barrier share one sequence: a rank calling barrier while another calls all_reduce_sum is a UsageError.
///    A rank that times out in a collective breaks the group's collectives: later ones throw TransportError.
///  - all_reduce_sum / broadcast take tensors of any size and dtype; device tensors are reduced through host
///    copies (correct, not fast: use NCCL for device-side gradient reduction). broadcast shares the sequence too.
///  - reduce_scatter_sum / all_gather share the sequence as well, and compare every rank's n and dtype on every
///    call (UsageError naming both ranks). reduce_scatter_sum sums the whole inputs in rank order, as
///    all_reduce_sum (so reduce_scatter_sum then all_gather is all_reduce_sum, bitwise), and each rank copies its
///    shard out; all_gather concatenates the shards in rank order. Their async forms are the blocking ones.
///  - split(color, key, timeout): one gathering all_reduce_sum in the parent's collective sequence, then the
///    first member of each color to get there creates a new shared state for the group and hands it to the
///    others through the parent's state. A group is an independent LocalTransportGroup: its own mailbox (its
///    messages never meet the parent's or another group's), its own collectives. An abort anywhere -- parent or
///    any group split from it, transitively -- fails every one of them, as an MPI abort ends the whole job (so a
///    rank failing in its data-parallel group does not leave its pipeline peers waiting for their timeouts).
///    Errors name the rank in the group, the
///    color and the rank in the parent. A group keeps its own state alive, so it may outlive the parent.
class LocalTransport final : public Transport {
 public:
  LocalTransport(std::shared_ptr<detail::LocalGroupState> state, int rank);
  ~LocalTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override;
  c10::Device device() const override;
  std::string name() const override;
  Pairing pairing() const override;
  /// True when the LocalTransportGroup this transport comes from (through any splits) has several ranks.
  bool ranks_share_process() const override;
  /// The rank threads of the LocalTransportGroup the family started from whose device is this rank's device.
  int ranks_sharing_device() const override;
  /// In-process: the hang report reads every rank of the group directly.
  std::shared_ptr<StatusBoard> status_board() const override;

  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  void all_reduce_sum(at::Tensor& tensor, Duration timeout) override;
  void barrier(Duration timeout) override;
  void broadcast(at::Tensor& tensor, int root, Duration timeout) override;
  void reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) override;
  void all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) override;
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override;
  void abort(const std::string& reason) override;

 private:
  using Combine = detail::LocalCombine;
  /// One collective of the group's sequence: `contribution` is this rank's host tensor (owned by the collective
  /// from here on; undefined for barrier), `signature` what every rank must pass alike ("input [10] Float"); `root`
  /// for Combine::kRoot. Returns the result, shared by the ranks: read it, never write it.
  at::Tensor collective(const std::string& kind, at::Tensor contribution, const std::string& signature,
                        Combine combine, Duration timeout, int root = -1);

  std::shared_ptr<detail::LocalGroupState> state_;
  int rank_;
  std::int64_t splits_ = 0;  // split() calls so far: with the color, names the group being handed out
};

/// Creates `world_size` LocalTransports that share one mailbox. The group may be destroyed before or after
/// the transports it handed out (they keep the shared state alive).
class LocalTransportGroup {
 public:
  explicit LocalTransportGroup(int world_size, LocalOptions options = {});

  int world_size() const { return static_cast<int>(transports_.size()); }

  /// The transport of `rank`, owned by the group; hand it to the thread that runs that rank.
  LocalTransport& transport(int rank);

  /// Transfers ownership of all transports to the caller (the group is empty afterwards).
  std::vector<std::unique_ptr<Transport>> release();

 private:
  std::vector<std::unique_ptr<LocalTransport>> transports_;
};

/// Shorthand for LocalTransportGroup(world_size, options).release().
std::vector<std::unique_ptr<Transport>> make_local_transports(int world_size, LocalOptions options = {});

}  // namespace twobp
