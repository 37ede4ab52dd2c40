#include "twobp/metrics/energy.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <vector>

#include "twobp/transport/launch.h"
#include "twobp/transport/transport.h"
#include "util/check.h"

namespace twobp::energy {
namespace {

// ---- RAPL (Linux powercap) ----

// Reads one unsigned number from a sysfs file; false (and errno's text in *why) when it cannot.
bool read_number(const std::string& path, uint64_t* value, std::string* why) {
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    *why = fmt::format("cannot open {} ({})", path, errno != 0 ? std::strerror(errno) : "unknown error");
    return false;
  }
  in >> *value;
  if (!in) {
    *why = fmt::format("cannot read a number from {}", path);
    return false;
  }
  return true;
}

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Names of the entries of a directory (POSIX: LibTorch's copies of std::filesystem symbols interpose on the
// standard library's in programs that link it).
std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

class RaplMeter final : public EnergyMeter {
 public:
  struct Zone {
    std::string name;  // "package-0", "dram"
    std::string energy_path;
    uint64_t range_uj = 0;  // the counter wraps to 0 after this value
    uint64_t last_uj = 0;
    double total_uj = 0;
  };

  explicit RaplMeter(std::vector<Zone> zones) : zones_(std::move(zones)) {}

  std::optional<double> joules() override {
    // Read every zone first, so that a failure leaves the accumulated totals as they were.
    std::vector<uint64_t> now(zones_.size());
    for (std::size_t k = 0; k < zones_.size(); ++k) {
      if (!read_number(zones_[k].energy_path, &now[k], &note_)) return std::nullopt;
    }
    note_.clear();
    double sum = 0;
    for (std::size_t k = 0; k < zones_.size(); ++k) {
      Zone& z = zones_[k];
      const uint64_t delta = now[k] >= z.last_uj ? now[k] - z.last_uj : now[k] + (z.range_uj - z.last_uj) + 1;
      z.total_uj += static_cast<double>(delta);
      z.last_uj = now[k];
      sum += z.total_uj;
    }
    return sum * 1e-6;
  }
  std::string source() const override { return "rapl"; }
  std::string scope() const override {
    std::string s;
    for (const auto& z : zones_) s += (s.empty() ? "" : " + ") + z.name;
    return s;
  }
  bool node_wide() const override { return true; }

 private:
  std::vector<Zone> zones_;
};

// ---- NVML, loaded at run time ----

// The few NVML entry points used, with the C signatures of nvml.h (nvmlReturn_t is an enum: 0 is success).
using NvmlReturn = int;
using NvmlDevice = struct NvmlDeviceOpaque*;
struct NvmlApi {
  void* library = nullptr;
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  const char* (*error_string)(NvmlReturn) = nullptr;
  NvmlReturn (*handle_by_index)(unsigned int, NvmlDevice*) = nullptr;
  NvmlReturn (*handle_by_uuid)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*uuid)(NvmlDevice, char*, unsigned int) = nullptr;
  NvmlReturn (*total_energy)(NvmlDevice, unsigned long long*) = nullptr;  // millijoules since the driver loaded

  std::string error(NvmlReturn r) const {
    const char* s = error_string != nullptr ? error_string(r) : nullptr;
    return s != nullptr ? fmt::format("{} (NVML error {})", s, r) : fmt::format("NVML error {}", r);
  }
};

class NvmlMeter final : public EnergyMeter {
 public:
  NvmlMeter(NvmlApi api, NvmlDevice device, std::string scope)
      : api_(api), device_(device), scope_(std::move(scope)) {}
  ~NvmlMeter() override { api_.shutdown(); }  // NVML counts init/shutdown pairs; the library stays loaded

  std::optional<double> joules() override {
    unsigned long long mj = 0;
    const NvmlReturn r = api_.total_energy(device_, &mj);
    if (r != 0) {
      note_ = fmt::format("nvmlDeviceGetTotalEnergyConsumption failed on {}: {}", scope_, api_.error(r));
      return std::nullopt;
    }
    note_.clear();
    return static_cast<double>(mj) * 1e-3;
  }
  std::string source() const override { return "nvml"; }
  std::string scope() const override { return scope_; }
  bool node_wide() const override { return false; }

 private:
  NvmlApi api_;
  NvmlDevice device_;
  std::string scope_;
};

template <typename F>
bool load_symbol(void* library, const char* name, F* out, std::string* why) {
  *out = reinterpret_cast<F>(::dlsym(library, name));
  if (*out == nullptr) *why = fmt::format("the NVML library has no {}", name);
  return *out != nullptr;
}

// The NVML device of CUDA device `cuda_index` as CUDA_VISIBLE_DEVICES maps it: {uuid, ""} or {"", index};
// *why set when it cannot be told.
bool nvml_device_of(int cuda_index, std::string* uuid, unsigned int* index, std::string* why) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) {
    *index = static_cast<unsigned int>(cuda_index);
    return true;
  }
  std::vector<std::string> entries;
  std::stringstream ss(visible);
  for (std::string e; std::getline(ss, e, ',');) entries.push_back(e);
  if (cuda_index < 0 || cuda_index >= static_cast<int>(entries.size())) {
    *why = fmt::format("CUDA device {} is not among CUDA_VISIBLE_DEVICES={}", cuda_index, visible);
    return false;
  }
  const std::string& e = entries[static_cast<std::size_t>(cuda_index)];
  if (e.rfind("GPU-", 0) == 0) {
    *uuid = e;
    return true;
  }
  if (e.rfind("MIG-", 0) == 0) {
    *why = fmt::format("CUDA device {} is a MIG instance ({}): NVML counts the energy of whole GPUs only",
                       cuda_index, e);
    return false;
  }
  if (!std::regex_match(e, std::regex("[0-9]+"))) {
    *why = fmt::format("cannot map CUDA_VISIBLE_DEVICES entry '{}' to an NVML device (set EnergyOptions::nvml_uuid)",
                       e);
    return false;
  }
  *index = static_cast<unsigned int>(std::stoul(e));
  return true;
}

}  // namespace

OpenedMeter open_rapl(const EnergyOptions& options) {
  const std::string& root = options.powercap_root;
  const std::vector<std::string> entries = list_directory(root);
  if (entries.empty()) return {nullptr, fmt::format("no RAPL: {} is absent or empty", root)};
  // Packages (intel-rapl:N) and their DRAM subzones (intel-rapl:N:M named "dram"); the class directory lists
  // every zone, subzones included. psys covers the whole platform, packages included; intel-rapl-mmio:N repeats a
  // package through another interface.
  static const std::regex package("intel-rapl:[0-9]+"), subzone("intel-rapl:[0-9]+:[0-9]+");
  std::vector<RaplMeter::Zone> zones;
  for (const std::string& e : entries) {
    const bool is_package = std::regex_match(e, package), is_sub = std::regex_match(e, subzone);
    if (!is_package && !is_sub) continue;
    const std::string dir = root + "/" + e;
    const std::string name = read_line(dir + "/name");
    if ((is_package && name == "psys") || (is_sub && name != "dram")) continue;
    RaplMeter::Zone z;
    z.name = name.empty() ? e : name;
    z.energy_path = dir + "/energy_uj";
    std::string why;
    if (!read_number(dir + "/max_energy_range_uj", &z.range_uj, &why) ||
        !read_number(z.energy_path, &z.last_uj, &why)) {
      return {nullptr, fmt::format("RAPL zone {} not readable: {} (energy_uj is readable only by root unless an "
                                   "administrator allows it, e.g. a udev rule or chmod a+r)",
                                   e, why)};
    }
    zones.push_back(std::move(z));
  }
  if (zones.empty()) return {nullptr, fmt::format("no RAPL package zone (intel-rapl:N) under {}", root)};
  return {std::make_unique<RaplMeter>(std::move(zones)), ""};
}

OpenedMeter open_nvml(int cuda_index, const EnergyOptions& options) {
  NvmlApi api;
  api.library = ::dlopen(options.nvml_library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (api.library == nullptr) {
    const char* e = ::dlerror();
    return {nullptr, fmt::format("no NVML: cannot load {} ({})", options.nvml_library, e != nullptr ? e : "")};
  }
  std::string why;
  if (!load_symbol(api.library, "nvmlInit_v2", &api.init, &why) ||
      !load_symbol(api.library, "nvmlShutdown", &api.shutdown, &why) ||
      !load_symbol(api.library, "nvmlErrorString", &api.error_string, &why) ||
      !load_symbol(api.library, "nvmlDeviceGetHandleByIndex_v2", &api.handle_by_index, &why) ||
      !load_symbol(api.library, "nvmlDeviceGetHandleByUUID", &api.handle_by_uuid, &why) ||
      !load_symbol(api.library, "nvmlDeviceGetUUID", &api.uuid, &why) ||
      !load_symbol(api.library, "nvmlDeviceGetTotalEnergyConsumption", &api.total_energy, &why)) {
    return {nullptr, why};
  }
  if (const NvmlReturn r = api.init(); r != 0) return {nullptr, "nvmlInit failed: " + api.error(r)};
  auto fail = [&](std::string text) {
    api.shutdown();
    return OpenedMeter{nullptr, std::move(text)};
  };
  std::string uuid = options.nvml_uuid;
  unsigned int index = 0;
  if (uuid.empty() && !nvml_device_of(cuda_index, &uuid, &index, &why)) return fail(why);
  NvmlDevice device = nullptr;
  const NvmlReturn r = uuid.empty() ? api.handle_by_index(index, &device) : api.handle_by_uuid(uuid.c_str(), &device);
  if (r != 0) {
    return fail(fmt::format("no NVML device {}: {}", uuid.empty() ? std::to_string(index) : uuid, api.error(r)));
  }
  char name[96] = {};
  if (api.uuid(device, name, sizeof(name)) == 0) uuid = name;
  unsigned long long mj = 0;
  if (const NvmlReturn e = api.total_energy(device, &mj); e != 0) {
    return fail(fmt::format("GPU {} has no energy counter (Volta or newer needed): {}", uuid, api.error(e)));
  }
  return {std::make_unique<NvmlMeter>(api, device, fmt::format("GPU {} ({})", cuda_index, uuid)), ""};
}

OpenedMeter open_meter(c10::Device device, const EnergyOptions& options) {
  if (device.is_cuda()) return open_nvml(device.has_index() ? device.index() : 0, options);
  if (device.is_cpu()) return open_rapl(options);
  return {nullptr, fmt::format("no energy meter for {} devices", c10::DeviceTypeName(device.type()))};
}

RankEnergy::RankEnergy(c10::Device device, bool first_on_node, const EnergyOptions& options) {
  OpenedMeter opened = open_meter(device, options);
  meter_ = std::move(opened.meter);
  note_ = std::move(opened.note);
  TWOBP_CHECK(options.ranks_sharing_device >= 1, UsageError,
              "EnergyOptions::ranks_sharing_device must be >= 1, got {}", options.ranks_sharing_device);
  if (meter_) {
    counts_ = !meter_->node_wide() || first_on_node;
    covered_ = !counts_;
    // A node-wide meter is read by one rank already; a per-device one by every rank on the device.
    if (!meter_->node_wide()) fraction_ = 1.0 / options.ranks_sharing_device;
  }
}

std::optional<double> RankEnergy::share() {
  if (covered_) return 0.0;
  if (!counts_) return std::nullopt;
  const std::optional<double> j = meter_->joules();
  return j ? std::optional<double>(*j * fraction_) : std::nullopt;
}

std::string RankEnergy::source() const { return meter_ ? meter_->source() : ""; }

std::string RankEnergy::note() const { return meter_ ? meter_->note() : note_; }

RankEnergy rank_energy(const Transport& world, c10::Device device, EnergyOptions options) {
  options.ranks_sharing_device = device.is_cpu() ? 1 : world.ranks_sharing_device();
  return RankEnergy(device, first_rank_on_node(world), options);
}

bool first_rank_on_node(const Transport& t) {
  const std::optional<LaunchEnv> env = launch_env();
  return env ? env->local_rank == 0 : t.rank() == 0;
}

std::optional<double> job_energy(Transport& t, std::optional<double> share, std::chrono::milliseconds timeout) {
  at::Tensor x = at::tensor({share.value_or(0.0), share ? 0.0 : 1.0}, at::kDouble);  // host values
  t.all_reduce_sum(x, timeout);
  if (x[1].item<double>() > 0) return std::nullopt;
  return x[0].item<double>();
}

}  // namespace twobp::energy
