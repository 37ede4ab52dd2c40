// Tensor memory per rank (see twobp/metrics/memory.h).

#include "twobp/metrics/memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <array>
#include <atomic>
#include <mutex>

#include "twobp/error.h"
#include "util/check.h"

namespace twobp::memory {
namespace {

struct Account {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
};

std::array<Account, kMaxAccounts>& accounts() {
  static std::array<Account, kMaxAccounts> all;
  return all;
}

thread_local int t_account = 0;

void charge(int account, int64_t bytes) {
  Account& a = accounts()[static_cast<std::size_t>(account)];
  const int64_t now = a.current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = a.peak.load(std::memory_order_relaxed);
  while (now > peak && !a.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Each block carries a header in front of the data with the account it was charged to and its size, so that a
// free on any thread credits the right account, and so that the raw deleter needs nothing but the data pointer
// (which lets LibTorch's raw_allocate() work with this allocator too). 64 bytes keep c10's 64-byte alignment.
struct Header {
  int64_t account;
  int64_t bytes;
};
constexpr std::size_t kHeaderBytes = 64;
static_assert(sizeof(Header) <= kHeaderBytes);

void counted_free(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeaderBytes;
  const Header h = *reinterpret_cast<const Header*>(base);
  charge(static_cast<int>(h.account), -h.bytes);
  c10::free_cpu(base);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    if (n == 0) return {nullptr, nullptr, &counted_free, c10::Device(c10::DeviceType::CPU)};
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeaderBytes));
    *reinterpret_cast<Header*>(base) = Header{t_account, static_cast<int64_t>(n)};
    charge(t_account, static_cast<int64_t>(n));
    void* data = base + kHeaderBytes;
    return {data, data, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator& counting_allocator() {
  static CountingCpuAllocator allocator;
  return allocator;
}

std::atomic<bool> g_counting{false};

// The device's caching allocator when it keeps statistics, else null.
c10::DeviceAllocator* device_allocator(c10::Device device) {
  if (device.is_cpu()) return nullptr;
  try {
    return dynamic_cast<c10::DeviceAllocator*>(c10::GetAllocator(device.type()));
  } catch (const std::exception&) {
    return nullptr;
  }
}

c10::DeviceIndex index_of(c10::Device device) {
  return device.has_index() ? device.index() : c10::impl::getDeviceGuardImpl(device.type())->getDevice().index();
}

constexpr auto kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);

}  // namespace

void count_cpu_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Priority above LibTorch's default CPU allocator (registered at 0).
    c10::SetCPUAllocator(&counting_allocator(), /*priority=*/1);
    g_counting = c10::GetCPUAllocator() == &counting_allocator();
  });
  TWOBP_CHECK(g_counting.load(), UsageError,
              "count_cpu_allocations: another CPU allocator of higher priority is installed in this process, so "
              "twobp cannot count CPU tensor memory; run without memory recording or limits");
}

bool counting_cpu_allocations() { return g_counting.load(); }

int current_account() { return t_account; }

ScopedAccount::ScopedAccount(int account) : previous_(t_account) {
  TWOBP_CHECK(account >= 0 && account < kMaxAccounts, UsageError,
              "memory::ScopedAccount: account {} is outside [0, {}) (one per rank of a process)", account,
              kMaxAccounts);
  t_account = account;
}

ScopedAccount::~ScopedAccount() { t_account = previous_; }

bool measurable(c10::Device device) {
  return device.is_cpu() ? counting_cpu_allocations() : device_allocator(device) != nullptr;
}

Allocated allocated(c10::Device device) {
  if (device.is_cpu()) {
    TWOBP_CHECK(counting_cpu_allocations(), UsageError,
                "CPU memory is measured by twobp's counting allocator: call twobp::memory::count_cpu_allocations() "
                "at the start of main(), before building the model");
    const Account& a = accounts()[static_cast<std::size_t>(t_account)];
    return {a.current.load(std::memory_order_relaxed), a.peak.load(std::memory_order_relaxed)};
  }
  c10::DeviceAllocator* alloc = device_allocator(device);
  TWOBP_CHECK(alloc != nullptr, UsageError, "the allocator of {} keeps no memory statistics", device.str());
  const auto stats = alloc->getDeviceStats(index_of(device));
  return {stats.allocated_bytes[kAggregate].current, stats.allocated_bytes[kAggregate].peak};
}

void reset_peak(c10::Device device) {
  if (device.is_cpu()) {
    Account& a = accounts()[static_cast<std::size_t>(t_account)];
    a.peak.store(a.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
    return;
  }
  if (c10::DeviceAllocator* alloc = device_allocator(device)) alloc->resetPeakStats(index_of(device));
}

std::string source(c10::Device device) {
  return device.is_cpu() ? "cpu allocation counter" : device.str() + " caching allocator";
}

}  // namespace twobp::memory
