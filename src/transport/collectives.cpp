#include "twobp/transport/collectives.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace twobp {

std::vector<double> sum_over_ranks(Transport& transport, const std::vector<double>& values, Duration timeout) {
  at::Tensor t = at::tensor(values, at::kDouble).to(transport.device());
  transport.all_reduce_sum(t, timeout);
  const at::Tensor host = t.cpu().contiguous();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}

std::vector<double> gather_over_ranks(Transport& transport, double value, Duration timeout) {
  std::vector<double> slots(static_cast<std::size_t>(transport.world_size()), 0.0);
  slots[static_cast<std::size_t>(transport.rank())] = value;
  return sum_over_ranks(transport, slots, timeout);
}

double max_over_ranks(Transport& transport, double value, Duration timeout) {
  const std::vector<double> slots = gather_over_ranks(transport, value, timeout);
  return *std::max_element(slots.begin(), slots.end());
}

}  // namespace twobp
