// A stand-in for libnvidia-ml with the C signatures of nvml.h, for energy_test: two GPUs (index 0 and 1, UUIDs
// GPU-fake-0 and GPU-fake-1) whose energy counters advance by 1500 mJ at every read. FAKE_NVML_NO_ENERGY=1 makes
// the counter unsupported (NVML_ERROR_NOT_SUPPORTED, as on GPUs older than Volta); FAKE_NVML_INIT_FAILS=1 makes
// nvmlInit fail (NVML_ERROR_DRIVER_NOT_LOADED, as without a driver).
#include <cstdlib>
#include <cstring>

namespace {
constexpr int kSuccess = 0, kInvalidArgument = 2, kNotSupported = 3, kDriverNotLoaded = 9, kNotFound = 6;
struct Device {
  const char* uuid;
  unsigned long long mj;
};
Device devices[2] = {{"GPU-fake-0", 1000000}, {"GPU-fake-1", 5000000}};
int inits = 0;
bool set(const char* name) { return std::getenv(name) != nullptr && std::strcmp(std::getenv(name), "1") == 0; }
}  // namespace

extern "C" {
int nvmlInit_v2() {
  if (set("FAKE_NVML_INIT_FAILS")) return kDriverNotLoaded;
  ++inits;
  return kSuccess;
}
int nvmlShutdown() { return inits-- > 0 ? kSuccess : kInvalidArgument; }
const char* nvmlErrorString(int r) {
  switch (r) {
    case kSuccess: return "Success";
    case kInvalidArgument: return "Invalid Argument";
    case kNotSupported: return "Not Supported";
    case kNotFound: return "Not Found";
    case kDriverNotLoaded: return "Driver Not Loaded";
    default: return "Unknown Error";
  }
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, Device** device) {
  if (inits <= 0) return kInvalidArgument;
  if (index >= 2) return kInvalidArgument;
  *device = &devices[index];
  return kSuccess;
}
int nvmlDeviceGetHandleByUUID(const char* uuid, Device** device) {
  for (Device& d : devices) {
    if (std::strcmp(d.uuid, uuid) == 0) {
      *device = &d;
      return kSuccess;
    }
  }
  return kNotFound;
}
int nvmlDeviceGetUUID(Device* device, char* out, unsigned int length) {
  std::strncpy(out, device->uuid, length - 1);
  return kSuccess;
}
int nvmlDeviceGetTotalEnergyConsumption(Device* device, unsigned long long* mj) {
  if (set("FAKE_NVML_NO_ENERGY")) return kNotSupported;
  device->mj += 1500;
  *mj = device->mj;
  return kSuccess;
}
}
