// Defaults of the Transport interface, and the base of wrapping transports.

#include "twobp/transport/transport.h"

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

}  // namespace

std::unique_ptr<Work> detail::completed_work() { return std::make_unique<CompletedWork>(); }

WrappingTransport::WrappingTransport(std::shared_ptr<Transport> inner, const char* wrapper)
    : inner_(std::move(inner)) {
  TWOBP_CHECK(inner_ != nullptr, UsageError, "{}: no transport to wrap", wrapper);
}

std::unique_ptr<Work> Transport::all_reduce_sum_async(at::Tensor& tensor, Duration timeout) {
  all_reduce_sum(tensor, timeout);
  return detail::completed_work();
}

}  // namespace twobp
