#include "twobp/transport/fault_injection.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <thread>

#include "transport/common.h"
#include "twobp/error.h"
#include "util/check.h"

namespace twobp {
namespace {

class FailedWork final : public Work {
 public:
  explicit FailedWork(std::string message) : message_(std::move(message)) {}
  void wait(Duration) override { throw TransportError(message_); }
  bool is_completed() override { throw TransportError(message_); }

 private:
  std::string message_;
};

// A send held back on a thread of its own (kReorder): complete once it was posted and its inner send completed.
class HeldWork final : public Work {
 public:
  explicit HeldWork(std::shared_future<std::shared_ptr<Work>> posted) : posted_(std::move(posted)) {}
  void wait(Duration timeout) override {
    const auto deadline = Clock::now() + timeout;
    if (posted_.wait_until(deadline) != std::future_status::ready) {
      throw TimeoutError(fmt::format("a held-back send (injected reorder) was not posted within {} ms",
                                     timeout.count()));
    }
    posted_.get()->wait(std::chrono::duration_cast<Duration>(std::max(deadline - Clock::now(), Clock::duration(0))));
  }
  bool is_completed() override {
    if (posted_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    return posted_.get()->is_completed();
  }

 private:
  std::shared_future<std::shared_ptr<Work>> posted_;
};

}  // namespace

const char* to_string(Fault fault) {
  switch (fault) {
    case Fault::kDelay: return "delay";
    case Fault::kDrop: return "drop";
    case Fault::kFailSend: return "fail-send";
    case Fault::kDie: return "die";
    case Fault::kDuplicate: return "duplicate";
    case Fault::kReorder: return "reorder";
    case Fault::kCorrupt: return "corrupt";
  }
  return "?";
}

void check_fault_options(const FaultOptions& o, int world_size) {
  TWOBP_CHECK(o.probability >= 0 && o.probability <= 1 && o.after_messages >= 0 && o.delay.count() >= 0 &&
                  o.max_faults >= -1,
              UsageError,
              "FaultOptions: probability must be in [0, 1], after_messages and delay >= 0, max_faults >= -1 (-1: no "
              "limit); got {}, {}, {} ms, {}",
              o.probability, o.after_messages, o.delay.count(), o.max_faults);
  TWOBP_CHECK(o.peer >= -1 && o.peer < world_size, UsageError,
              "FaultOptions: peer {} is outside the world of {} ranks (0 .. {}; -1: any peer), so no send would be "
              "chosen",
              o.peer, world_size, world_size - 1);
  for (int r : o.ranks) {
    TWOBP_CHECK(r >= 0 && r < world_size, UsageError,
                "FaultOptions: rank {} in `ranks` is outside the world of {} ranks (0 .. {}; empty: every rank), so "
                "it would never inject",
                r, world_size, world_size - 1);
  }
}

FaultInjectingTransport::FaultInjectingTransport(std::shared_ptr<Transport> inner, FaultOptions options)
    : FaultInjectingTransport(std::move(inner), std::move(options), Split{}) {
  check_fault_options(options_, inner_->world_size());
}

FaultInjectingTransport::FaultInjectingTransport(std::shared_ptr<Transport> inner, FaultOptions options, Split)
    : WrappingTransport(std::move(inner), "FaultInjectingTransport"), options_(std::move(options)) {
  random_.seed(options_.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(inner_->rank()) + 1);
}

std::string FaultInjectingTransport::name() const {
  return fmt::format("{} (injecting {})", inner_->name(), to_string(options_.fault));
}

bool FaultInjectingTransport::chosen(const P2POptions& o) {
  const auto& ranks = options_.ranks;
  if (!ranks.empty() && std::find(ranks.begin(), ranks.end(), rank()) == ranks.end()) return false;
  if (options_.peer >= 0 && o.peer != options_.peer) return false;
  if (!options_.label_contains.empty() && o.label.find(options_.label_contains) == std::string::npos) return false;
  if (++eligible_ <= options_.after_messages) return false;
  if (options_.max_faults >= 0 && faults_ >= options_.max_faults) return false;
  if (options_.fault == Fault::kDie) return true;
  return std::uniform_real_distribution<double>(0.0, 1.0)(random_) < options_.probability;
}

std::unique_ptr<Work> FaultInjectingTransport::isend(const at::Tensor& tensor, const P2POptions& o) {
  ++sends_;
  TWOBP_CHECK(!dead_, TransportError, "rank {} is dead (injected fault), cannot send {} to rank {}", rank(), o.label,
              o.peer);
  // In-order pairing: a send never overtakes a held one on its own channel (the contract forbids it).
  const bool in_order = pairing() == Pairing::kInOrderPerChannel;
  if (in_order) {
    auto held = held_.find({o.peer, o.channel});
    if (held != held_.end()) {
      if (held->second.wait_for(o.timeout) != std::future_status::ready) {
        throw TimeoutError(fmt::format("rank {}: {} waited more than {} ms behind a held-back send (injected "
                                       "reorder)", rank(), o.label, o.timeout.count()));
      }
      held_.erase(held);
    }
  }
  if (!chosen(o)) return inner_->isend(tensor, o);
  ++faults_;
  switch (options_.fault) {
    case Fault::kDelay:
      std::this_thread::sleep_for(options_.delay);
      return inner_->isend(tensor, o);
    case Fault::kDrop:
      return detail::completed_work();
    case Fault::kFailSend:
      return std::make_unique<FailedWork>(
          fmt::format("rank {}: send of {} to rank {} failed (injected fault)", rank(), o.label, o.peer));
    case Fault::kDie: {
      dead_ = true;
      const std::string why = fmt::format("rank {} died after {} messages (injected fault), before sending {} to "
                                          "rank {}", rank(), options_.after_messages, o.label, o.peer);
      inner_->abort(why);
      throw TransportError(why);
    }
    case Fault::kDuplicate: {
      std::vector<std::unique_ptr<Work>> both;
      both.push_back(inner_->isend(tensor, o));
      both.push_back(inner_->isend(tensor, o));
      return std::make_unique<detail::JoinedWork>(std::move(both), std::vector<at::Tensor>{});
    }
    case Fault::kCorrupt: {
      // The top bit of one element's last byte: on this little-endian layout, the sign of a float or an integer,
      // so the change always matters (a low mantissa bit could hide below a comparison's tolerance).
      at::Tensor copy = tensor.clone();
      if (copy.numel() > 0) {
        const at::Tensor bytes = copy.flatten().view(at::kByte);
        const auto element = std::uniform_int_distribution<int64_t>(0, copy.numel() - 1)(random_);
        bytes.narrow(0, (element + 1) * copy.element_size() - 1, 1).bitwise_xor_(0x80);
      }
      std::vector<std::unique_ptr<Work>> send;
      send.push_back(inner_->isend(copy, o));
      return std::make_unique<detail::JoinedWork>(std::move(send), std::vector<at::Tensor>{copy});
    }
    case Fault::kReorder: {
      // The inner transport must take sends from two threads: Local and Store do; MPI serializes its calls.
      std::shared_future<std::shared_ptr<Work>> posted =
          std::async(std::launch::async, [inner = inner_, tensor, o, delay = options_.delay] {
            std::this_thread::sleep_for(delay);
            return std::shared_ptr<Work>(inner->isend(tensor, o));
          }).share();
      if (in_order) held_[{o.peer, o.channel}] = posted;
      return std::make_unique<HeldWork>(std::move(posted));
    }
  }
  return inner_->isend(tensor, o);
}

std::unique_ptr<Work> FaultInjectingTransport::irecv(at::Tensor& buffer, const P2POptions& o) {
  TWOBP_CHECK(!dead_, TransportError, "rank {} is dead (injected fault), cannot receive {} from rank {}", rank(),
              o.label, o.peer);
  return inner_->irecv(buffer, o);
}

std::unique_ptr<Transport> FaultInjectingTransport::split(int color, int key, Duration timeout) {
  std::unique_ptr<Transport> child = inner_->split(color, key, timeout);
  if (!child) return nullptr;
  // The group's ranks are numbered anew: the options checked against the world apply to them as they are.
  return std::unique_ptr<Transport>(
      new FaultInjectingTransport(std::shared_ptr<Transport>(std::move(child)), options_, Split{}));
}

}  // namespace twobp
