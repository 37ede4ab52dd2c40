#include "twobp/random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "util/hash.h"

namespace twobp {

namespace {
// The innermost scope of this thread: a thread runs one forward at a time (a Stage is used by one thread at a
// time), so a thread-local pointer is all the state there is -- nothing here is shared between rank threads.
thread_local StageRandomScope* current_scope = nullptr;
}  // namespace

StageRandomScope::StageRandomScope(uint64_t seed, int stage, int micro_batch, int64_t pass)
    : key_(detail::mix_key({seed, static_cast<uint64_t>(stage), static_cast<uint64_t>(micro_batch),
                            static_cast<uint64_t>(pass)})),
      outer_(current_scope) {
  current_scope = this;
}

StageRandomScope::~StageRandomScope() { current_scope = outer_; }

at::Generator StageRandomScope::generator(c10::Device device) {
  // One generator per device kind and index; a CPU device has index -1 or 0 alike.
  const c10::Device where = device.is_cpu() ? c10::Device(c10::kCPU) : device;
  for (const auto& [device_of, g] : generators_) {
    if (device_of == where) return g;
  }
  at::Generator g;
  if (where.is_cpu()) {
    g = at::make_generator<at::CPUGeneratorImpl>(key_);
  } else if (where.is_cuda()) {
    // Through ATen's hooks, so that this file needs no CUDA library (the CPU-only build has none).
    g = at::detail::getCUDAHooks().getNewGenerator(where.has_index() ? where.index() : 0);
    g.set_current_seed(key_);
  } else {
    return at::Generator();
  }
  generators_.emplace_back(where, g);
  return g;
}

at::Generator stage_generator(c10::Device device) {
  return current_scope != nullptr ? current_scope->generator(device) : at::Generator();
}

}  // namespace twobp
