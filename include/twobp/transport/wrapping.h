#pragma once
// The base of transports that wrap another one (FaultInjectingTransport, ChecksummingTransport): every call goes
// to the wrapped transport unless the wrapper overrides it, so a wrapper states only what it changes -- and a
// method added to Transport is forwarded by every wrapper at once.

#include <memory>
#include <string>
#include <utility>

#include "twobp/transport/transport.h"

namespace twobp {

class WrappingTransport : public Transport {
 public:
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  c10::Device device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name(); }
  int world_rank_of(int group_rank) const override { return inner_->world_rank_of(group_rank); }
  Pairing pairing() const override { return inner_->pairing(); }
  bool ranks_share_process() const override { return inner_->ranks_share_process(); }
  int ranks_sharing_device() const override { return inner_->ranks_sharing_device(); }
  bool receives_hold_device() const override { return inner_->receives_hold_device(); }
  std::shared_ptr<StatusBoard> status_board() const override { return inner_->status_board(); }

  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override {
    return inner_->isend(tensor, options);
  }
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override {
    return inner_->irecv(buffer, options);
  }
  void all_reduce_sum(at::Tensor& tensor, Duration timeout) override { inner_->all_reduce_sum(tensor, timeout); }
  std::unique_ptr<Work> all_reduce_sum_async(at::Tensor& tensor, Duration timeout) override {
    return inner_->all_reduce_sum_async(tensor, timeout);
  }
  bool asynchronous_all_reduce() const override { return inner_->asynchronous_all_reduce(); }
  void reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) override {
    inner_->reduce_scatter_sum(input, output, timeout);
  }
  std::unique_ptr<Work> reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                 Duration timeout) override {
    return inner_->reduce_scatter_sum_async(input, output, timeout);
  }
  void all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) override {
    inner_->all_gather(shard, output, timeout);
  }
  std::unique_ptr<Work> all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout) override {
    return inner_->all_gather_async(shard, output, timeout);
  }
  bool asynchronous_sharded_collectives() const override { return inner_->asynchronous_sharded_collectives(); }
  void broadcast(at::Tensor& tensor, int root, Duration timeout) override {
    inner_->broadcast(tensor, root, timeout);
  }
  /// A wrapper must say how its groups are wrapped.
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override = 0;
  void barrier(Duration timeout) override { inner_->barrier(timeout); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

  const std::shared_ptr<Transport>& inner() const { return inner_; }

 protected:
  /// UsageError (naming `wrapper`) when `inner` is null.
  WrappingTransport(std::shared_ptr<Transport> inner, const char* wrapper);

  std::shared_ptr<Transport> inner_;
};

}  // namespace twobp
