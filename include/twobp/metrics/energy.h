#pragma once
// Energy of a training job, in joules, from the hardware's own counters:
//  - CUDA devices: NVML's total energy counter of the GPU (nvmlDeviceGetTotalEnergyConsumption, Volta and newer),
//    with libnvidia-ml loaded at run time (dlopen), so twobp neither links nor needs it. GPU board energy only: the
//    host's CPUs and memory are not in it.
//  - CPU: RAPL through Linux powercap (/sys/class/powercap/intel-rapl:N/energy_uj, which AMD processors expose under
//    the same name): every package zone plus its "dram" subzones, psys (the whole platform, which would count the
//    packages twice) and the intel-rapl-mmio copies left out. Counter wrap-arounds are folded in
//    (max_energy_range_uj).
// Where neither exists -- no NVML library, a GPU without the counter, no powercap, energy_uj readable only by root
// (the kernel's default since 2020) -- there is no meter and a note says why: energy is then reported as unknown,
// never as 0, and never fails a run.
//
// A job's energy is the sum of its ranks' shares (job_energy): a per-device meter (NVML) is read by the rank that
// owns the device; a node-wide meter (RAPL counts the whole socket, whichever process runs there) by one rank per
// node only. The total is unknown when a rank whose hardware no other rank measures has no meter.
//
// Which NVML device is CUDA device d: NVML numbers GPUs in PCI bus order. CUDA_VISIBLE_DEVICES entries (indices or
// GPU-<uuid>) are honoured; CUDA itself numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which is
// the same order on nodes of identical GPUs (the usual training node). Set EnergyOptions::nvml_uuid where it is not.

#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

namespace twobp {
class Transport;
}

namespace twobp::energy {

/// A cumulative energy counter of some hardware: joules since an arbitrary origin, non-decreasing. One per rank;
/// not thread-safe.
class EnergyMeter {
 public:
  virtual ~EnergyMeter() = default;
  /// The counter now; nullopt when reading it failed (note() then says why; later reads may succeed again).
  virtual std::optional<double> joules() = 0;
  /// "nvml" or "rapl".
  virtual std::string source() const = 0;
  /// What it measures, for reports: "GPU 0 (GPU-8c0e...)" or "package-0 + dram".
  virtual std::string scope() const = 0;
  /// True when it counts hardware every process of the node shares (RAPL): then one rank per node reads it.
  virtual bool node_wide() const = 0;
  /// Why the last read failed ("" when it did not).
  const std::string& note() const { return note_; }

 protected:
  std::string note_;
};

struct EnergyOptions {
  /// Where powercap lives (tests and containers that mount sysfs elsewhere give another root).
  std::string powercap_root = "/sys/class/powercap";
  /// The NVML library dlopen() loads.
  std::string nvml_library = "libnvidia-ml.so.1";
  /// The GPU's NVML UUID ("GPU-..."); empty: found from the CUDA device index (see the top of this file).
  std::string nvml_uuid;
  /// Ranks that compute on this rank's device and each read its per-device meter (Transport::ranks_sharing_device,
  /// e.g. rank threads on one GPU): each contributes 1/n of the reading, so that the job's sum counts the GPU once.
  int ranks_sharing_device = 1;
};

/// A meter, or none (null) and why.
struct OpenedMeter {
  std::unique_ptr<EnergyMeter> meter;
  std::string note;  // why there is no meter; "" when there is one
};

/// RAPL of this machine's packages (and their DRAM zones).
OpenedMeter open_rapl(const EnergyOptions& options = {});
/// NVML of CUDA device `cuda_index` (or of options.nvml_uuid).
OpenedMeter open_nvml(int cuda_index, const EnergyOptions& options = {});
/// The meter of the hardware a rank computing on `device` runs on: NVML for CUDA devices, RAPL for CPU; none for
/// other devices. Never throws for missing hardware, libraries or permissions.
OpenedMeter open_meter(c10::Device device, const EnergyOptions& options = {});

/// One rank's share of its job's energy. Construct it on every rank (it is cheap and opens the meter once), read
/// share() around what is measured, and sum the differences with job_energy().
class RankEnergy {
 public:
  /// `first_on_node`: whether this rank reads node-wide meters for its node (first_rank_on_node()).
  RankEnergy(c10::Device device, bool first_on_node, const EnergyOptions& options = {});
  /// Cumulative joules this rank contributes: its meter's reading; 0 when another rank of the node reads the
  /// node-wide meter this rank's hardware is in; nullopt when this rank's hardware goes unmeasured.
  std::optional<double> share();
  /// "nvml", "rapl" or "" (no meter).
  std::string source() const;
  /// Why energy is unknown on this rank ("" when it is measured).
  std::string note() const;

 private:
  std::unique_ptr<EnergyMeter> meter_;
  std::string note_;
  bool counts_ = false;  // meter_ is read by this rank
  bool covered_ = false;  // this rank's hardware is measured by another rank's node-wide meter
  double fraction_ = 1.0;  // of the reading that is this rank's (EnergyOptions::ranks_sharing_device)
};

/// Whether this rank of the job's world `t` is the first of its node: LOCAL_RANK (or the launcher's equivalent,
/// launch_env()) is 0 under a launcher; ranks started as threads of one process (no launcher) are one node, whose
/// first is `t`'s rank 0. `t` is the whole job, not a pipeline or data-parallel group.
bool first_rank_on_node(const Transport& t);

/// The RankEnergy of this rank of the job `world` (the whole job, as for first_rank_on_node) computing on `device`:
/// node-wide meters read by the node's first rank, a device's own meter divided among the ranks of this process on
/// that device (EnergyOptions::ranks_sharing_device is set from Transport::ranks_sharing_device; a CPU's meter is
/// node-wide, never divided). What both programs construct on every rank.
RankEnergy rank_energy(const Transport& world, c10::Device device, EnergyOptions options = {});

/// The job's energy from every rank's share (a difference of RankEnergy::share() readings): their sum over `t`'s
/// ranks, or nullopt when any rank's share is nullopt. Collective over `t`: every rank calls it, in the same order.
std::optional<double> job_energy(Transport& t, std::optional<double> share, std::chrono::milliseconds timeout);

}  // namespace twobp::energy
