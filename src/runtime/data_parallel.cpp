#include "twobp/runtime/data_parallel.h"

#include "util/check.h"

namespace twobp {

ParallelLayout ParallelLayout::of(int world_size, int dp) {
  TWOBP_CHECK(dp >= 1 && world_size >= 1 && world_size % dp == 0, UsageError,
              "{} ranks cannot form {} data-parallel replicas: the world size must be a multiple of dp (world = dp "
              "x pp, pp ranks per pipeline)",
              world_size, dp);
  return ParallelLayout{dp, world_size / dp};
}

ParallelGroups::ParallelGroups(Transport& world, int dp, Duration timeout)
    : world_(world), layout_(ParallelLayout::of(world.world_size(), dp)) {
  const int r = world.rank();
  replica_ = layout_.replica(r);
  pipeline_rank_ = layout_.pipeline_rank(r);
  if (dp == 1) return;
  // Both splits are collectives over the world, made in this order on every rank.
  pipeline_ = world.split(/*color=*/replica_, /*key=*/pipeline_rank_, timeout);
  data_parallel_ = world.split(/*color=*/pipeline_rank_, /*key=*/replica_, timeout);
  TWOBP_CHECK(pipeline_ && data_parallel_ && pipeline_->rank() == pipeline_rank_ &&
                  data_parallel_->rank() == replica_,
              TransportError, "rank {}: splitting the world into dp {} x pp {} gave group ranks {} and {}, expected {} "
              "and {}", r, layout_.dp, layout_.pp, pipeline_ ? pipeline_->rank() : -1,
              data_parallel_ ? data_parallel_->rank() : -1, pipeline_rank_, replica_);
}

// Children before the parent they may share state with (Transport::split); the parent is the caller's.
ParallelGroups::~ParallelGroups() {
  data_parallel_.reset();
  pipeline_.reset();
}

}  // namespace twobp
