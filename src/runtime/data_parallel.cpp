#include "twobp/runtime/data_parallel.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/group_transport.h"
#include "twobp/transport/status_board.h"
#include "twobp/transport/wrapping.h"
#include "util/check.h"

namespace twobp {
namespace {

// A group's view of its world's status board: the group's rank r is the world's rank members[r], and collect()
// answers for every rank of the world (index = world rank), so that a hang report follows waits from one group
// into another (a replica late to the gradient reduction because its pipeline waits on a stuck rank).
class WorldBoardView final : public StatusBoard {
 public:
  WorldBoardView(std::shared_ptr<StatusBoard> world, std::vector<int> members)
      : world_(std::move(world)), members_(std::move(members)) {}
  void attach(int rank, Reader reader) override { world_->attach(member(rank), std::move(reader)); }
  void detach(int rank) override { world_->detach(member(rank)); }
  std::vector<std::optional<std::string>> collect(int rank, std::int64_t incident, Duration wait) override {
    return world_->collect(member(rank), incident, wait);
  }
  std::string agree_on_report(std::int64_t incident, const std::string& report) override {
    return world_->agree_on_report(incident, report);
  }

 private:
  int member(int rank) const {
    TWOBP_CHECK(rank >= 0 && rank < static_cast<int>(members_.size()), UsageError,
                "status board of a group of {} ranks: no rank {}", members_.size(), rank);
    return members_[static_cast<std::size_t>(rank)];
  }
  std::shared_ptr<StatusBoard> world_;
  std::vector<int> members_;
};

// One group of ParallelGroups: the split transport, naming its ranks by their world ranks and reporting through
// the world's status board (when the world has one).
class GroupTransport final : public WrappingTransport {
 public:
  // members[r]: the rank in `world` of the group's rank r.
  GroupTransport(std::unique_ptr<Transport> group, const Transport& world, const std::vector<int>& members)
      : WrappingTransport(std::shared_ptr<Transport>(std::move(group)), "ParallelGroups") {
    for (int m : members) world_ranks_.push_back(world.world_rank_of(m));
    if (auto board = world.status_board()) board_ = std::make_shared<WorldBoardView>(std::move(board), members);
  }
  int world_rank_of(int group_rank) const override {
    TWOBP_CHECK(group_rank >= 0 && group_rank < static_cast<int>(world_ranks_.size()), UsageError,
                "a group of {} ranks has no rank {}", world_ranks_.size(), group_rank);
    return world_ranks_[static_cast<std::size_t>(group_rank)];
  }
  std::shared_ptr<StatusBoard> status_board() const override { return board_ ? board_ : inner_->status_board(); }
  // A group of this group is numbered within it, with a board of its own (as any split).
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override {
    return inner_->split(color, key, timeout);
  }

 private:
  std::vector<int> world_ranks_;
  std::shared_ptr<StatusBoard> board_;
};

}  // namespace

std::unique_ptr<Transport> detail::world_named_group(std::unique_ptr<Transport> group, const Transport& parent,
                                                     const std::vector<int>& members) {
  if (group == nullptr) return nullptr;
  return std::make_unique<GroupTransport>(std::move(group), parent, members);
}

const char* to_string(ZeroStage stage) {
  switch (stage) {
    case ZeroStage::k0:
      return "0";
    case ZeroStage::k1:
      return "1";
    case ZeroStage::k2:
      return "2";
  }
  return "?";
}

ZeroStage parse_zero_stage(const std::string& text) {
  for (ZeroStage z : {ZeroStage::k0, ZeroStage::k1, ZeroStage::k2}) {
    if (text == to_string(z)) return z;
  }
  throw UsageError("unknown ZeRO stage '" + text + "': expected 0 (nothing sharded), 1 (optimizer state) or 2 "
                   "(gradients and optimizer state)");
}

std::int64_t collective_bytes_sent(CollectiveKind kind, std::int64_t bytes, int world) {
  if (world <= 1) return 0;
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return 2 * bytes * (world - 1) / world;
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllGather:
    case CollectiveKind::kBroadcast:
      return bytes * (world - 1) / world;
  }
  return 0;
}

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
  std::vector<int> stages_of_replica, replicas_of_stage;
  for (int p = 0; p < layout_.pp; ++p) stages_of_replica.push_back(layout_.world_rank(replica_, p));
  for (int d = 0; d < layout_.dp; ++d) replicas_of_stage.push_back(layout_.world_rank(d, pipeline_rank_));
  pipeline_ = detail::world_named_group(std::move(pipeline_), world, stages_of_replica);
  data_parallel_ = detail::world_named_group(std::move(data_parallel_), world, replicas_of_stage);
}

// Children before the parent they may share state with (Transport::split); the parent is the caller's.
ParallelGroups::~ParallelGroups() {
  data_parallel_.reset();
  pipeline_.reset();
}

}  // namespace twobp
