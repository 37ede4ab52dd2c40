#include "util/reduce.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace twobp::detail {

std::vector<double> sum_over_ranks(Transport& transport, const std::vector<double>& values, Duration timeout) {
  at::Tensor t = at::tensor(values, at::kDouble).to(transport.device());
  transport.all_reduce_sum(t, timeout);
  const at::Tensor host = t.cpu().contiguous();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}

double max_over_ranks(Transport& transport, double value, Duration timeout) {
  std::vector<double> slots(static_cast<std::size_t>(transport.world_size()), 0.0);
  slots[static_cast<std::size_t>(transport.rank())] = value;
  slots = sum_over_ranks(transport, slots, timeout);
  return *std::max_element(slots.begin(), slots.end());
}

}  // namespace twobp::detail
