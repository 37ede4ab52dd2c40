#pragma once
// Private helpers shared by the transports: describing tensors in error messages, validating the arguments of
// isend/irecv the same way everywhere, and the poll-with-backoff loop behind every wait(timeout).

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "twobp/transport/transport.h"
#include "util/check.h"

namespace twobp::detail {

/// "[2, 3] float" -- the form every shape/dtype error uses, so that expected and actual read alike.
inline std::string describe_tensor(at::IntArrayRef sizes, c10::ScalarType dtype) {
  std::ostringstream out;
  out << sizes << ' ' << c10::toString(dtype);
  return out.str();
}

/// The handle of an operation that finished before it was returned (defined in transport.cpp).
std::unique_ptr<Work> completed_work();

/// One handle for several operations (a wrapper's sends: a message and its checksum, or a send of a copy): waits
/// for each in order within one deadline, is complete when all are, and keeps `keep_alive` (the tensors the
/// operations read or write that nobody else holds) until it is destroyed.
class JoinedWork final : public Work {
 public:
  JoinedWork(std::vector<std::unique_ptr<Work>> works, std::vector<at::Tensor> keep_alive)
      : works_(std::move(works)), keep_alive_(std::move(keep_alive)) {}
  void wait(Duration timeout) override {
    const Clock::time_point deadline = Clock::now() + timeout;
    for (auto& w : works_) {
      w->wait(std::max(Duration(0), std::chrono::duration_cast<Duration>(deadline - Clock::now())));
    }
  }
  bool is_completed() override {
    return std::all_of(works_.begin(), works_.end(), [](const auto& w) { return w->is_completed(); });
  }

 private:
  std::vector<std::unique_ptr<Work>> works_;
  std::vector<at::Tensor> keep_alive_;
};

inline std::string describe_tensor(const at::Tensor& t) { return describe_tensor(t.sizes(), t.scalar_type()); }

/// "SEND_F stage 1 micro-batch 3", or "tag 7" when the caller gave no label: an error must always say which
/// operation it is about.
inline std::string describe_op(const P2POptions& options) {
  return options.label.empty() ? fmt::format("tag {}", options.tag) : options.label;
}

/// Checks what every transport requires of isend/irecv arguments; raises UsageError naming the rank and op.
inline void check_p2p_args(const char* what, int rank, int world_size, const at::Tensor& tensor,
                           const P2POptions& options) {
  TWOBP_CHECK(options.peer >= 0 && options.peer < world_size && options.peer != rank, UsageError,
              "rank {}: {} {}: peer {} is invalid (world size {}, and a rank cannot talk to itself)", rank, what,
              describe_op(options), options.peer, world_size);
  TWOBP_CHECK(options.tag >= 0, UsageError, "rank {}: {} {}: tag {} must be non-negative", rank, what,
              describe_op(options), options.tag);
  TWOBP_CHECK(options.channel >= 0, UsageError, "rank {}: {} {}: channel {} must be non-negative", rank, what,
              describe_op(options), options.channel);
  TWOBP_CHECK(tensor.defined(), UsageError, "rank {}: {} {}: the tensor is undefined", rank, what,
              describe_op(options));
  TWOBP_CHECK(tensor.is_contiguous(), UsageError, "rank {}: {} {}: the tensor {} must be contiguous", rank, what,
              describe_op(options), describe_tensor(tensor));
}

/// Sleeps between polls of a non-blocking completion test. Starts by yielding (a message between threads or
/// processes on one node usually lands within microseconds) -- 16 times, or for `spin_for` when that is longer --
/// and backs off to `max_sleep` so that a long wait does not burn a core the compute threads need.
class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds max_sleep = std::chrono::microseconds(1000),
                   std::chrono::microseconds spin_for = std::chrono::microseconds(0))
      : max_(max_sleep), spin_until_(Clock::now() + spin_for) {}

  void pause() {
    if (spins_ < 16 || Clock::now() < spin_until_) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(max_, sleep_ * 2);
  }

 private:
  std::chrono::microseconds max_;
  Clock::time_point spin_until_;
  std::chrono::microseconds sleep_{1};
  int spins_ = 0;
};

/// Deadline of a wait(timeout); a negative or huge timeout saturates instead of overflowing.
inline Clock::time_point deadline_after(Duration timeout) {
  const auto now = Clock::now();
  if (timeout.count() < 0) return now;
  if (timeout > std::chrono::duration_cast<Duration>(Clock::time_point::max() - now)) return Clock::time_point::max();
  return now + timeout;
}

/// What is left of a wait until `deadline` (0 once it passed), for the next of several waits within one deadline.
inline Duration time_left(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return Duration::max();
  return std::max(Duration(0), std::chrono::duration_cast<Duration>(deadline - Clock::now()));
}

/// UsageError (naming `who` and what was expected) unless `input` and `output` are what reduce_scatter_sum takes on
/// rank `rank` of `world`: both defined, 1-D and contiguous, of one dtype and device, `output` holding
/// shard_range(input.numel(), world, rank).size() elements. Defined in transport.cpp.
void check_reduce_scatter_args(const std::string& who, int world, int rank, const at::Tensor& input,
                               const at::Tensor& output);
/// The same for all_gather: `shard` holds shard_range(output.numel(), world, rank).size() elements.
void check_all_gather_args(const std::string& who, int world, int rank, const at::Tensor& shard,
                           const at::Tensor& output);

/// For transports that cannot compare the ranks' tensors within the collective itself (MPI, NCCL): one
/// all_reduce_sum over `via` (the transport, or NCCL's host) of every rank's (`kind`, n, dtype), each in a row of
/// its own. UsageError on every rank, naming what each rank passed, when they differ; the all-reduce's
/// TimeoutError / TransportError rethrown naming `kind`. `kind`: "reduce_scatter_sum" or "all_gather".
void check_ranks_agree(Transport& via, const std::string& who, const char* kind, std::int64_t n,
                       c10::ScalarType dtype, Duration timeout);

}  // namespace twobp::detail

namespace twobp::detail {

/// Every rank's (color, key), gathered with ONE all_reduce_sum over `parent` (each rank fills its own row of a
/// [world, 2] int64 tensor, zeros elsewhere): split is thus one collective in the parent's sequence, bounded by
/// `timeout` like any other, on every transport that can sum. A rank that never arrives turns into the
/// collective's TimeoutError, rethrown with "split" and the color in the message.
inline std::vector<std::pair<int, int>> gather_split_colors(Transport& parent, int color, int key,
                                                            Duration timeout) {
  const int world = parent.world_size();
  at::Tensor rows = at::zeros({world, 2}, at::TensorOptions().dtype(at::kLong).device(parent.device()));
  at::Tensor mine = at::tensor({static_cast<std::int64_t>(color), static_cast<std::int64_t>(key)},
                               at::TensorOptions().dtype(at::kLong));
  rows[parent.rank()].copy_(mine);
  try {
    parent.all_reduce_sum(rows, timeout);
  } catch (const TimeoutError& e) {
    raise<TimeoutError>("rank {}: split (color {}) timed out: {}", parent.rank(), color, e.what());
  } catch (const UsageError& e) {
    raise<UsageError>("rank {}: split (color {}) failed: {}", parent.rank(), color, e.what());
  } catch (const TransportError& e) {
    raise<TransportError>("rank {}: split (color {}) failed: {}", parent.rank(), color, e.what());
  }
  rows = rows.to(at::kCPU).contiguous();
  const auto* p = rows.data_ptr<std::int64_t>();
  std::vector<std::pair<int, int>> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) out[r] = {static_cast<int>(p[2 * r]), static_cast<int>(p[2 * r + 1])};
  return out;
}

/// The parent ranks of group `color`, ordered by (key, parent rank): index = rank in the group.
inline std::vector<int> split_members(const std::vector<std::pair<int, int>>& colors, int color) {
  std::vector<int> members;
  for (int r = 0; r < static_cast<int>(colors.size()); ++r) {
    if (colors[r].first == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return colors[a].second < colors[b].second; });
  return members;
}

/// How a rank of a group names itself in errors: "rank 1 (group color 0, rank 2 in the parent)".
inline std::string group_member_name(int group_rank, int color, const std::string& parent_name) {
  return fmt::format("rank {} (group color {}, {} in the parent)", group_rank, color, parent_name);
}

}  // namespace twobp::detail
