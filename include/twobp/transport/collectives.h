#pragma once
// Agreements over a transport's ranks on host numbers (measured costs, step times, peaks, flags): one all-reduce of
// a double tensor on the transport's device, the result back on the host, identical on every rank. Each is
// collective: every rank of the transport calls it, in the same order, with the same number of values.

#include <vector>

#include "twobp/transport/transport.h"

namespace twobp {

/// `values` summed element-wise over the transport's ranks.
std::vector<double> sum_over_ranks(Transport& transport, const std::vector<double>& values, Duration timeout);

/// Every rank's `value`, indexed by rank (each rank's in a slot of its own, one sum).
std::vector<double> gather_over_ranks(Transport& transport, double value, Duration timeout);

/// The largest of the ranks' `value`.
double max_over_ranks(Transport& transport, double value, Duration timeout);

}  // namespace twobp
