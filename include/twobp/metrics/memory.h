#pragma once
// Tensor memory of one rank, in bytes: how much it holds now and the most it held since a reset. The runtime reads
// it around every action (PipelineOptions::executor.record_memory) to report peaks, to feed the memory simulator
// (simulate_peak_memory in twobp/schedule/simulate.h) and to bound 2BP's deferred work in bytes
// (PipelineOptions::executor.memory_limit_bytes).
//
// Where the numbers come from:
//  - CUDA (and other devices with a caching allocator): the allocator's "allocated bytes" statistics
//    (c10::DeviceAllocator::getDeviceStats, what torch.cuda.memory_allocated reports). One rank per device, so the
//    device's numbers are the rank's. Resetting the peak resets the allocator's peak statistics of that device.
//  - CPU: a counting allocator that twobp installs as LibTorch's CPU allocator (count_cpu_allocations()). It
//    charges each allocation to the allocating thread's account, and a free to the account that allocated it
//    (whatever thread frees it), so ranks running as threads of one process are told apart: run_ranks and
//    run_rank_threads give each rank thread the account of its rank. Only tensor storage is counted (not the
//    allocator caches of oneDNN or BLAS scratch space, nor the interpreter's own heap), which is the memory the
//    pipeline's choices change; the process's resident set (getrusage) is a different, larger number.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace twobp::memory {

/// Bytes of tensor memory: held now, and the most held since the last reset_peak().
struct Allocated {
  int64_t current = 0;
  int64_t peak = 0;
};

/// Accounts of the CPU counter: one per rank of a process (ranks as threads), numbered from 0.
inline constexpr int kMaxAccounts = 1024;

/// Installs the counting CPU allocator (idempotent, thread-safe). Tensors allocated before it are neither counted
/// nor uncounted when freed, so call it at the start of main(), before building models. Throws UsageError when
/// another CPU allocator of higher priority is installed (ours would not be used).
void count_cpu_allocations();
/// Whether count_cpu_allocations() ran in this process.
bool counting_cpu_allocations();

/// The calling thread's account (0 unless set): CPU allocations made on this thread are charged to it.
int current_account();

/// Charges the calling thread's CPU allocations to `account` (in [0, kMaxAccounts)) until destroyed, then restores
/// the previous account. run_rank_threads gives each rank thread the account of its rank.
class ScopedAccount {
 public:
  explicit ScopedAccount(int account);
  ~ScopedAccount();
  ScopedAccount(const ScopedAccount&) = delete;
  ScopedAccount& operator=(const ScopedAccount&) = delete;

 private:
  int previous_;
};

/// Whether allocated() can measure `device` (CPU: once count_cpu_allocations() ran; other devices: when their
/// allocator keeps statistics).
bool measurable(c10::Device device);

/// The calling rank's tensor memory on `device` (CPU: the calling thread's account). Throws UsageError when
/// !measurable(device), saying what to do.
Allocated allocated(c10::Device device);

/// Starts a new peak: the peak becomes the current bytes (CPU: of the calling thread's account; other devices: of
/// the whole device).
void reset_peak(c10::Device device);

/// Where allocated() gets its numbers for `device`, for reports: "cpu allocation counter" or "<device> caching
/// allocator".
std::string source(c10::Device device);

}  // namespace twobp::memory
