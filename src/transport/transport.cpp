// Defaults of the Transport interface.

#include "twobp/transport/transport.h"

namespace twobp {
namespace {

// The handle of an operation that finished before it was returned.
class CompletedWork final : public Work {
 public:
  void wait(Duration) override {}
  bool is_completed() override { return true; }
};

}  // namespace

std::unique_ptr<Work> Transport::all_reduce_sum_async(at::Tensor& tensor, Duration timeout) {
  all_reduce_sum(tensor, timeout);
  return std::make_unique<CompletedWork>();
}

}  // namespace twobp
