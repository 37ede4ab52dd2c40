#pragma once
// Small agreements over a transport's ranks on host numbers (measured costs, step times, flags): one all-reduce of
// a double tensor on the transport's device, the result back on the host, identical on every rank.

#include <vector>

#include "twobp/transport/transport.h"

namespace twobp::detail {

/// `values` summed over the transport's ranks (every rank passes the same number of values). Collective.
std::vector<double> sum_over_ranks(Transport& transport, const std::vector<double>& values, Duration timeout);

/// The max over the transport's ranks of `value` (each rank's in a slot of its own, one sum). Collective.
double max_over_ranks(Transport& transport, double value, Duration timeout);

}  // namespace twobp::detail
