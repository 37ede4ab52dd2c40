// Defaults of the Transport interface, the base of wrapping transports, and the checks every transport's
// reduce_scatter_sum / all_gather share (the layout rule itself: shard_range).

#include "twobp/transport/transport.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <vector>

#include "transport/common.h"
#include "twobp/transport/wrapping.h"
#include "util/check.h"

namespace twobp {
namespace {

class CompletedWork final : public Work {
 public:
  void wait(Duration) override {}
  bool is_completed() override { return true; }
};

// "[3] Float on cpu": what a flat collective's tensor is, or must be.
std::string describe_flat(std::int64_t numel, c10::ScalarType dtype, c10::Device device) {
  return fmt::format("{} on {}", detail::describe_tensor({numel}, dtype), device.str());
}

// UsageError unless `t` (the collective's `role`: "input", "shard", "output") is defined, 1-D and contiguous.
void check_flat(const std::string& who, const char* what, const char* role, const at::Tensor& t) {
  TWOBP_CHECK(t.defined(), UsageError, "{}: {}: the {} is undefined", who, what, role);
  TWOBP_CHECK(t.dim() == 1 && t.is_contiguous(), UsageError,
              "{}: {}: the {} must be a flat (1-D) contiguous tensor, got {}{}", who, what, role,
              detail::describe_tensor(t), t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace

std::unique_ptr<Work> detail::completed_work() { return std::make_unique<CompletedWork>(); }

ShardRange shard_range(std::int64_t n, int world, int rank) {
  TWOBP_CHECK(n >= 0 && world >= 1 && rank >= 0 && rank < world, UsageError,
              "shard_range(n = {}, world = {}, rank = {}): expected n >= 0, world >= 1 and 0 <= rank < world", n,
              world, rank);
  const std::int64_t q = n / world, m = n % world;
  const auto start = [&](std::int64_t r) { return r * q + std::min(r, m); };
  return ShardRange{start(rank), start(rank + 1)};
}

void detail::check_reduce_scatter_args(const std::string& who, int world, int rank, const at::Tensor& input,
                                       const at::Tensor& output) {
  const char* what = "reduce_scatter_sum";
  check_flat(who, what, "input", input);
  check_flat(who, what, "output", output);
  const ShardRange mine = shard_range(input.numel(), world, rank);
  TWOBP_CHECK(output.numel() == mine.size() && output.scalar_type() == input.scalar_type() &&
                  output.device() == input.device(),
              UsageError,
              "{}: {}: the output must hold this rank's shard [{}, {}) of the {}-element input (shard_range({}, {}, "
              "{})): expected {}, got {}",
              who, what, mine.begin, mine.end, input.numel(), input.numel(), world, rank,
              describe_flat(mine.size(), input.scalar_type(), input.device()),
              describe_flat(output.numel(), output.scalar_type(), output.device()));
}

void detail::check_all_gather_args(const std::string& who, int world, int rank, const at::Tensor& shard,
                                   const at::Tensor& output) {
  const char* what = "all_gather";
  check_flat(who, what, "shard", shard);
  check_flat(who, what, "output", output);
  const ShardRange mine = shard_range(output.numel(), world, rank);
  TWOBP_CHECK(shard.numel() == mine.size() && shard.scalar_type() == output.scalar_type() &&
                  shard.device() == output.device(),
              UsageError,
              "{}: {}: the shard must be this rank's part [{}, {}) of the {}-element output (shard_range({}, {}, "
              "{})): expected {}, got {}",
              who, what, mine.begin, mine.end, output.numel(), output.numel(), world, rank,
              describe_flat(mine.size(), output.scalar_type(), output.device()),
              describe_flat(shard.numel(), shard.scalar_type(), shard.device()));
}

void detail::check_ranks_agree(Transport& via, const std::string& who, const char* kind, std::int64_t n,
                               c10::ScalarType dtype, Duration timeout) {
  // One row per rank, (collective, n, dtype), zeros elsewhere: the sum is every rank's row (exact in int64).
  const int world = via.world_size();
  const std::int64_t code = std::string(kind) == "all_gather" ? 2 : 1;
  at::Tensor rows = at::zeros({world, 3}, at::kLong);
  rows[via.rank()].copy_(at::tensor({code, n, static_cast<std::int64_t>(dtype)}, at::kLong));
  const std::string what = fmt::format("{} (comparing what the ranks pass, on its first call)", kind);
  try {
    via.all_reduce_sum(rows, timeout);
  } catch (const TimeoutError& e) {
    raise<TimeoutError>("{}: {} timed out: {}", who, what, e.what());
  } catch (const UsageError& e) {
    raise<UsageError>("{}: {} failed: {}", who, what, e.what());
  } catch (const TransportError& e) {
    raise<TransportError>("{}: {} failed: {}", who, what, e.what());
  }
  const auto* p = rows.data_ptr<std::int64_t>();
  bool agree = true;
  std::string all;
  for (int r = 0; r < world; ++r) {
    const std::int64_t* row = p + 3 * r;
    agree = agree && row[0] == code && row[1] == n && row[2] == static_cast<std::int64_t>(dtype);
    const bool known = row[0] >= 1 && row[0] <= 2 && row[2] >= 0 &&
                       row[2] < static_cast<std::int64_t>(c10::ScalarType::NumOptions);
    all += fmt::format("{}rank {}: {}", r == 0 ? "" : ", ", r,
                       known ? fmt::format("{} of {}", row[0] == 2 ? "all_gather" : "reduce_scatter_sum",
                                           describe_tensor({row[1]}, static_cast<c10::ScalarType>(row[2])))
                             : std::string("another collective"));
  }
  TWOBP_CHECK(agree, UsageError,
              "{}: {}: the ranks disagree ({}): every rank must pass the same number of elements and dtype, calling "
              "the collectives in the same order",
              who, what, all);
}

WrappingTransport::WrappingTransport(std::shared_ptr<Transport> inner, const char* wrapper)
    : inner_(std::move(inner)) {
  TWOBP_CHECK(inner_ != nullptr, UsageError, "{}: no transport to wrap", wrapper);
}

std::unique_ptr<Work> Transport::all_reduce_sum_async(at::Tensor& tensor, Duration timeout) {
  all_reduce_sum(tensor, timeout);
  return detail::completed_work();
}

void Transport::reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) {
  detail::check_reduce_scatter_args(fmt::format("rank {}", rank()), world_size(), rank(), input, output);
  // WHY a copy: all_reduce_sum sums in place, and the caller's input stays theirs.
  at::Tensor sum = input.clone();
  all_reduce_sum(sum, timeout);
  const ShardRange mine = shard_range(input.numel(), world_size(), rank());
  output.copy_(sum.narrow(0, mine.begin, mine.size()));
}

std::unique_ptr<Work> Transport::reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                          Duration timeout) {
  reduce_scatter_sum(input, output, timeout);
  return detail::completed_work();
}

void Transport::all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  detail::check_all_gather_args(fmt::format("rank {}", rank()), world_size(), rank(), shard, output);
  // Each rank's shard broadcast from it into its range of every rank's output (a contiguous view), in rank order.
  const auto deadline = detail::deadline_after(timeout);
  for (int r = 0; r < world_size(); ++r) {
    const ShardRange range = shard_range(output.numel(), world_size(), r);
    at::Tensor part = output.narrow(0, range.begin, range.size());
    if (r == rank()) part.copy_(shard);
    broadcast(part, r, detail::time_left(deadline));
  }
}

std::unique_ptr<Work> Transport::all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  all_gather(shard, output, timeout);
  return detail::completed_work();
}

}  // namespace twobp
