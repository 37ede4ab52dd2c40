#include "twobp/trace/trace.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstddef>

#include "twobp/error.h"
#include "util/check.h"

namespace twobp {
namespace {

// One rank's trace as doubles (every value is an integer below 2^53 or a time): step_us, then per event
// [rank, type, stage, overlapped, start_us, end_us, recompute_us, memory_before, memory_after, memory_peak,
// number of micro-batches, micro-batches...].
constexpr std::size_t kFixedFields = 11;

std::vector<double> encode(const Trace& trace) {
  std::vector<double> out{trace.step_us};
  for (const TraceEvent& e : trace.events) {
    const Action& a = e.action;
    out.insert(out.end(), {static_cast<double>(e.rank), static_cast<double>(a.type), static_cast<double>(a.stage),
                           a.overlapped_with_next ? 1.0 : 0.0, e.start_us, e.end_us, e.recompute_us,
                           static_cast<double>(e.memory_before), static_cast<double>(e.memory_after),
                           static_cast<double>(e.memory_peak), static_cast<double>(a.micro_batches.size())});
    for (int mb : a.micro_batches) out.push_back(mb);
  }
  return out;
}

Trace decode(const double* values, std::size_t size, int rank) {
  Trace trace;
  TWOBP_CHECK(size >= 1, TransportError, "gather_traces: rank {} sent an empty trace", rank);
  trace.step_us = values[0];
  std::size_t at = 1;
  while (at < size) {
    TWOBP_CHECK(at + kFixedFields <= size, TransportError, "gather_traces: rank {}'s trace is cut short", rank);
    const double* v = values + at;
    TraceEvent e;
    e.rank = static_cast<int>(v[0]);
    e.action.type = static_cast<ActionType>(static_cast<int>(v[1]));
    e.action.stage = static_cast<int>(v[2]);
    e.action.overlapped_with_next = v[3] != 0.0;
    e.start_us = v[4];
    e.end_us = v[5];
    e.recompute_us = v[6];
    e.memory_before = static_cast<int64_t>(v[7]);
    e.memory_after = static_cast<int64_t>(v[8]);
    e.memory_peak = static_cast<int64_t>(v[9]);
    const auto micro_batches = static_cast<std::size_t>(v[10]);
    at += kFixedFields;
    TWOBP_CHECK(at + micro_batches <= size, TransportError, "gather_traces: rank {}'s trace is cut short", rank);
    for (std::size_t k = 0; k < micro_batches; ++k) e.action.micro_batches.push_back(static_cast<int>(values[at + k]));
    at += micro_batches;
    trace.events.push_back(std::move(e));
  }
  return trace;
}

}  // namespace

std::vector<Trace> gather_traces(Transport& transport, const Trace& mine, Duration timeout) {
  const int world = transport.world_size(), rank = transport.rank();
  const auto on_device = at::TensorOptions().dtype(at::kDouble).device(transport.device());
  const std::vector<double> encoded = encode(mine);
  // First every rank's length, then the traces, each in its own row of a [world, longest] sum.
  at::Tensor sizes = at::zeros({world}, on_device);
  sizes[rank] = static_cast<double>(encoded.size());
  transport.all_reduce_sum(sizes, timeout);
  const at::Tensor host_sizes = sizes.cpu();
  const double* size_of = host_sizes.data_ptr<double>();
  const auto longest = static_cast<int64_t>(*std::max_element(size_of, size_of + world));
  at::Tensor rows = at::zeros({world, longest}, at::kDouble);
  std::copy(encoded.begin(), encoded.end(), rows[rank].data_ptr<double>());
  at::Tensor all = rows.to(transport.device());
  transport.all_reduce_sum(all, timeout);
  const at::Tensor host = all.cpu();
  std::vector<Trace> traces;
  for (int r = 0; r < world; ++r) {
    traces.push_back(decode(host[r].data_ptr<double>(), static_cast<std::size_t>(size_of[r]), r));
  }
  return traces;
}

}  // namespace twobp
