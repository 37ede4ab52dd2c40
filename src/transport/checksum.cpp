#include "twobp/transport/checksum.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <utility>

#include "transport/common.h"
#include "util/check.h"

namespace twobp {
namespace {

// Checksum messages take the data message's tag with this bit set: by-tag transports keep them apart from every
// data message (whose tags stay far below it); in-order transports pair them by position on the same channel.
constexpr std::int64_t kChecksumTagBit = std::int64_t{1} << 61;

P2POptions checksum_options(const P2POptions& o) {
  TWOBP_CHECK(o.tag >= 0 && o.tag < kChecksumTagBit, UsageError,
              "ChecksummingTransport: {}: tag {} is outside [0, 2^61), which the checksum messages need",
              detail::describe_op(o), o.tag);
  P2POptions c = o;
  c.tag = o.tag | kChecksumTagBit;
  c.label = detail::describe_op(o) + " (checksum)";
  return c;
}

class RecvWork final : public Work {
 public:
  RecvWork(std::unique_ptr<Work> data, std::unique_ptr<Work> sum, at::Tensor buffer, at::Tensor expected,
           std::string what)
      : data_(std::move(data)), sum_(std::move(sum)), buffer_(std::move(buffer)), expected_(std::move(expected)),
        what_(std::move(what)) {}
  void wait(Duration timeout) override {
    data_->wait(timeout);
    sum_->wait(timeout);
    verify();
  }
  bool is_completed() override {
    if (!data_->is_completed() || !sum_->is_completed()) return false;
    verify();
    return true;
  }

 private:
  void verify() {
    if (verified_) return;
    verified_ = true;
    const std::int64_t want = expected_.item<std::int64_t>(), got = message_checksum(buffer_).item<std::int64_t>();
    TWOBP_CHECK(want == got, TransportError,
                "{}: checksum mismatch: the sender's bytes sum to {}, the received ones to {} -- the message was "
                "corrupted in transit",
                what_, want, got);
  }

  std::unique_ptr<Work> data_, sum_;
  at::Tensor buffer_, expected_;
  std::string what_;
  bool verified_ = false;
};

}  // namespace

at::Tensor message_checksum(const at::Tensor& tensor) {
  const at::Tensor bytes = tensor.contiguous().flatten().view(at::kByte);
  // 32-bit words where the size allows (half the temporary of bytes), widened so the sum wraps deterministically.
  const at::Tensor words = bytes.numel() % 4 == 0 ? bytes.view(at::kInt) : bytes;
  return words.to(at::kLong).sum().reshape({1});
}

ChecksummingTransport::ChecksummingTransport(std::shared_ptr<Transport> inner)
    : WrappingTransport(std::move(inner), "ChecksummingTransport") {}

std::unique_ptr<Work> ChecksummingTransport::isend(const at::Tensor& tensor, const P2POptions& options) {
  const P2POptions c = checksum_options(options);
  at::Tensor sum = message_checksum(tensor);
  auto data = inner_->isend(tensor, options);
  auto sent = inner_->isend(sum, c);
  std::vector<std::unique_ptr<Work>> works;
  works.push_back(std::move(data));
  works.push_back(std::move(sent));
  return std::make_unique<detail::JoinedWork>(std::move(works), std::vector<at::Tensor>{std::move(sum)});
}

std::unique_ptr<Work> ChecksummingTransport::irecv(at::Tensor& buffer, const P2POptions& options) {
  const P2POptions c = checksum_options(options);
  at::Tensor expected = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(buffer.device()));
  auto data = inner_->irecv(buffer, options);
  auto sum = inner_->irecv(expected, c);
  return std::make_unique<RecvWork>(
      std::move(data), std::move(sum), buffer, std::move(expected),
      fmt::format("rank {}: {} from rank {}", rank(), detail::describe_op(options), options.peer));
}

std::unique_ptr<Transport> ChecksummingTransport::split(int color, int key, Duration timeout) {
  std::unique_ptr<Transport> child = inner_->split(color, key, timeout);
  if (!child) return nullptr;
  return std::make_unique<ChecksummingTransport>(std::shared_ptr<Transport>(std::move(child)));
}

}  // namespace twobp
