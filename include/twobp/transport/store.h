#pragma once
// StoreTransport: CPU tensors between processes through a c10d::Store -- LibTorch's TCPStore, the rendezvous
// torchrun and torch.distributed use. It is what a job launched without MPI (torchrun, srun) uses to bootstrap
// NcclTransport and to run its small collectives; its point-to-point operations work too (slowly: every
// message is a store key), which lets CPU pipelines and tests run across processes without MPI.

#include <memory>
#include <string>

#include "twobp/transport/launch.h"
#include "twobp/transport/transport.h"

namespace twobp {

struct StoreOptions {
  /// Bound on connecting to the store (rank 0 serves it) and on the barrier that ends construction.
  Duration connect_timeout{120000};
  /// Prefix of every key this transport writes: several transports may share one store.
  std::string prefix = "twobp";
};

/// One rank of a job whose ranks meet at a c10d::Store.
///
/// Semantics (Pairing::kByTag): isend writes the message under (prefix, src, dst, tag, n), n counting the sends
/// with that (dst, tag); it is complete at once (buffered). irecv reads key n of the n-th receive with that
/// (src, tag): messages with equal tags arrive in the order they were sent. wait() polls the store with back-off
/// until the message is there or the timeout (TimeoutError naming the peer and the label), then checks shape and
/// dtype against the buffer (UsageError naming both ranks and both shapes) and deletes the key.
/// all_reduce_sum / barrier: every rank writes its contribution under the collective's sequence number; sums run
/// in rank order (bitwise reproducible). abort(reason) writes an abort key: every pending and later wait of every
/// rank throws TransportError naming this rank and the reason (checked at every poll).
/// A store that becomes unreachable (rank 0 died) makes operations throw TransportError.
/// all_reduce_sum takes CPU tensors of any size (each contribution is one store value; fine for gradient buckets
/// of a few MB, slow beyond). broadcast: the root writes its tensor, the others only their arrival.
/// reduce_scatter_sum: each rank writes each of its input's shards for its owner alone, and each rank sums the ones
/// it owns in rank order (all_reduce_sum's bits); all_gather: each rank writes its shard, every rank reads all.
/// Every value carries the kind and what the rank passed (n, dtype): a rank that disagrees is a UsageError naming
/// both ranks, on every call. Their async forms are the blocking ones.
/// split(color, key, timeout): one gathering all_reduce_sum over the parent, then each group works on the same
/// store under its own key prefix (<prefix>/split<n>/color<c>) with group-local ranks: its messages, collectives
/// and abort key never meet the parent's or another group's (an abort in a group fails its members only). The
/// group shares the parent's store connection: destroy groups before their parent.
///
/// Threading: one thread per transport.
class StoreTransport final : public Transport {
 public:
  /// Rank `env.rank` of `env.world_size`; rank 0 serves a TCPStore at env.master_addr:env.master_port, the
  /// others connect to it. Construction is collective (ends with a barrier).
  explicit StoreTransport(const LaunchEnv& env, StoreOptions options = {});
  ~StoreTransport() override;

  int rank() const override;
  int world_size() const override;
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string name() const override { return "store"; }
  Pairing pairing() const override { return pairing_of("store"); }

  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  void all_reduce_sum(at::Tensor& tensor, Duration timeout) override;
  void barrier(Duration timeout) override;
  void broadcast(at::Tensor& tensor, int root, Duration timeout) override;
  void reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) override;
  void all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) override;
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override;
  void abort(const std::string& reason) override;
  /// Through the store: see StoreStatusBoard in store_transport.cpp.
  std::shared_ptr<StatusBoard> status_board() const override;

  struct Impl;

 private:
  explicit StoreTransport(std::shared_ptr<Impl> impl);  // a group made by split()
  std::shared_ptr<Impl> impl_;
};

}  // namespace twobp
