// Energy meters of twobp/metrics/energy.h: RAPL on a powercap tree written here (which zones count, wrap-around,
// unreadable counters), NVML through a stand-in library loaded like the real one (fake_nvml.cpp: device mapping,
// errors), and the job's energy as the sum of rank shares (one reader per node-wide meter, unknown when a rank's
// hardware goes unmeasured).

#include "twobp/metrics/energy.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <fstream>
#include <string>
#include <vector>

#include "common/temp_files.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

const c10::Device kCpu(c10::DeviceType::CPU);

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text << "\n"; }

// A powercap tree with one zone per entry: {directory, name, energy_uj, max_energy_range_uj}.
struct Zone {
  std::string dir, name;
  uint64_t energy, range;
};

class PowercapTree : public ::testing::Test {
 protected:
  void SetUp() override { root_ = make_temp_dir("powercap"); }
  void TearDown() override { remove_tree(root_); }

  void add(const Zone& z) {
    const std::string dir = root_ + "/" + z.dir;
    ::mkdir(dir.c_str(), 0755);
    write(dir + "/name", z.name);
    write(dir + "/energy_uj", std::to_string(z.energy));
    write(dir + "/max_energy_range_uj", std::to_string(z.range));
  }
  void set_energy(const std::string& zone, uint64_t uj) {
    write(root_ + "/" + zone + "/energy_uj", std::to_string(uj));
  }
  // A machine with two packages, DRAM zones, a core zone, psys and an MMIO copy of package 0.
  void add_machine() {
    add({"intel-rapl:0", "package-0", 1000, 1000000});
    add({"intel-rapl:0:0", "core", 500, 1000000});
    add({"intel-rapl:0:1", "dram", 100, 1000000});
    add({"intel-rapl:1", "package-1", 2000, 1000000});
    add({"intel-rapl:2", "psys", 9000, 1000000});
    add({"intel-rapl-mmio:0", "package-0", 1000, 1000000});
  }
  energy::EnergyOptions options() const {
    energy::EnergyOptions o;
    o.powercap_root = root_;
    return o;
  }
  std::string root_;
};

TEST_F(PowercapTree, CountsPackagesAndDramOnly) {
  add_machine();
  energy::OpenedMeter opened = energy::open_rapl(options());
  ASSERT_TRUE(opened.meter) << opened.note;
  EXPECT_EQ(opened.meter->source(), "rapl");
  EXPECT_TRUE(opened.meter->node_wide());
  EXPECT_EQ(opened.meter->scope(), "package-0 + dram + package-1");
  ASSERT_EQ(opened.meter->joules(), 0.0);  // the origin is the opening
  set_energy("intel-rapl:0", 4000);      // +3000
  set_energy("intel-rapl:0:0", 99999);   // core: inside the package, not counted again
  set_energy("intel-rapl:0:1", 600);     // +500
  set_energy("intel-rapl:1", 3000);      // +1000
  set_energy("intel-rapl:2", 1000000);   // psys: not counted
  set_energy("intel-rapl-mmio:0", 900000);
  EXPECT_DOUBLE_EQ(*opened.meter->joules(), 4500e-6);
}

TEST_F(PowercapTree, FoldsCounterWrapArounds) {
  add({"intel-rapl:0", "package-0", 990, 999});  // the counter runs 0..999 and wraps to 0
  auto meter = energy::open_rapl(options()).meter;
  ASSERT_TRUE(meter);
  set_energy("intel-rapl:0", 5);  // 990 -> 999 (9), wrap (1), 0 -> 5 (5)
  EXPECT_DOUBLE_EQ(*meter->joules(), 15e-6);
  set_energy("intel-rapl:0", 20);
  EXPECT_DOUBLE_EQ(*meter->joules(), 30e-6);
}

TEST_F(PowercapTree, AFailedReadIsUnknownAndLosesNothing) {
  add({"intel-rapl:0", "package-0", 100, 1000000});
  auto meter = energy::open_rapl(options()).meter;
  ASSERT_TRUE(meter);
  set_energy("intel-rapl:0", 300);
  ASSERT_DOUBLE_EQ(*meter->joules(), 200e-6);
  ASSERT_EQ(::remove((root_ + "/intel-rapl:0/energy_uj").c_str()), 0);
  EXPECT_FALSE(meter->joules().has_value());
  EXPECT_NE(meter->note().find("energy_uj"), std::string::npos) << meter->note();
  set_energy("intel-rapl:0", 400);
  EXPECT_DOUBLE_EQ(*meter->joules(), 300e-6);
  EXPECT_EQ(meter->note(), "");
}

TEST_F(PowercapTree, NoMeterWithAReasonWhenAbsentEmptyOrUnreadable) {
  energy::OpenedMeter empty = energy::open_rapl(options());
  EXPECT_FALSE(empty.meter);
  EXPECT_NE(empty.note.find(root_), std::string::npos) << empty.note;

  energy::EnergyOptions absent;
  absent.powercap_root = root_ + "/nowhere";
  EXPECT_NE(energy::open_rapl(absent).note.find("absent"), std::string::npos);

  add({"intel-rapl:2", "psys", 1, 10});  // a platform zone only
  EXPECT_NE(energy::open_rapl(options()).note.find("no RAPL package zone"), std::string::npos);

  // A counter that cannot be read (as energy_uj is for non-root users): a directory in its place.
  add({"intel-rapl:0", "package-0", 1, 10});
  ASSERT_EQ(::remove((root_ + "/intel-rapl:0/energy_uj").c_str()), 0);
  ::mkdir((root_ + "/intel-rapl:0/energy_uj").c_str(), 0755);
  energy::OpenedMeter unreadable = energy::open_rapl(options());
  EXPECT_FALSE(unreadable.meter);
  EXPECT_NE(unreadable.note.find("intel-rapl:0 not readable"), std::string::npos) << unreadable.note;
  EXPECT_NE(unreadable.note.find("root"), std::string::npos) << unreadable.note;
}

// ---- NVML ----

class NvmlTest : public ::testing::Test {
 protected:
  void TearDown() override {
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    ::unsetenv("FAKE_NVML_NO_ENERGY");
    ::unsetenv("FAKE_NVML_INIT_FAILS");
  }
  static energy::EnergyOptions fake() {
    energy::EnergyOptions o;
    o.nvml_library = TWOBP_FAKE_NVML;
    return o;
  }
};

TEST_F(NvmlTest, ReadsTheGpuCounterInJoules) {
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  energy::OpenedMeter opened = energy::open_nvml(1, fake());
  ASSERT_TRUE(opened.meter) << opened.note;
  EXPECT_EQ(opened.meter->source(), "nvml");
  EXPECT_FALSE(opened.meter->node_wide());
  EXPECT_EQ(opened.meter->scope(), "GPU 1 (GPU-fake-1)");
  const double a = *opened.meter->joules(), b = *opened.meter->joules();
  EXPECT_DOUBLE_EQ(b - a, 1.5);  // the stand-in advances 1500 mJ per read
}

TEST_F(NvmlTest, MapsCudaDevicesThroughCudaVisibleDevices) {
  ::setenv("CUDA_VISIBLE_DEVICES", "1,0", 1);
  EXPECT_EQ(energy::open_nvml(0, fake()).meter->scope(), "GPU 0 (GPU-fake-1)");
  EXPECT_EQ(energy::open_nvml(1, fake()).meter->scope(), "GPU 1 (GPU-fake-0)");
  ::setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-1", 1);
  EXPECT_EQ(energy::open_nvml(0, fake()).meter->scope(), "GPU 0 (GPU-fake-1)");
  energy::OpenedMeter outside = energy::open_nvml(1, fake());
  EXPECT_FALSE(outside.meter);
  EXPECT_NE(outside.note.find("not among CUDA_VISIBLE_DEVICES=GPU-fake-1"), std::string::npos) << outside.note;
  ::setenv("CUDA_VISIBLE_DEVICES", "MIG-1234", 1);
  EXPECT_NE(energy::open_nvml(0, fake()).note.find("MIG"), std::string::npos);
  ::setenv("CUDA_VISIBLE_DEVICES", "gpu0", 1);
  EXPECT_NE(energy::open_nvml(0, fake()).note.find("nvml_uuid"), std::string::npos);
  // An explicit UUID wins over the mapping.
  energy::EnergyOptions o = fake();
  o.nvml_uuid = "GPU-fake-0";
  EXPECT_EQ(energy::open_nvml(0, o).meter->scope(), "GPU 0 (GPU-fake-0)");
}

// Rank threads on one GPU each read its meter: each counts 1/n of it, so the job's sum counts the GPU once.
TEST_F(NvmlTest, RanksSharingAGpuEachCountTheirFraction) {
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  energy::EnergyOptions two = fake();
  two.ranks_sharing_device = 2;
  energy::RankEnergy alone(c10::Device(c10::kCUDA, 1), /*first_on_node=*/true, fake());
  energy::RankEnergy half(c10::Device(c10::kCUDA, 1), /*first_on_node=*/false, two);
  const double a0 = *alone.share(), a1 = *alone.share();
  const double h0 = *half.share(), h1 = *half.share();
  EXPECT_DOUBLE_EQ(a1 - a0, 1.5);   // the stand-in advances 1500 mJ per read
  EXPECT_DOUBLE_EQ(h1 - h0, 0.75);  // half of it
  two.ranks_sharing_device = 0;
  EXPECT_THROW({ energy::RankEnergy bad(c10::Device(c10::kCUDA, 1), true, two); }, UsageError);
}

// rank_energy: rank threads of one process on one GPU divide its meter among them (the sharing counted by the
// transport); on the CPU the node's first rank reads the node-wide meter and the others count 0, undivided.
TEST_F(NvmlTest, RankEnergyDividesASharedGpusMeterAmongItsRanks) {
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  for (int ranks : {1, 2, 3}) {
    LocalOptions o;
    o.devices = {c10::Device(c10::kCUDA, 1)};
    auto transports = make_local_transports(ranks, o);
    for (int r = 0; r < ranks; ++r) {
      energy::RankEnergy e = energy::rank_energy(*transports[r], c10::Device(c10::kCUDA, 1), fake());
      EXPECT_EQ(e.source(), "nvml");
      const double a = *e.share(), b = *e.share();
      EXPECT_DOUBLE_EQ(b - a, 1.5 / ranks) << ranks << " ranks";  // the stand-in advances 1500 mJ per read
    }
  }
}

TEST_F(NvmlTest, NoMeterWithAReason) {
  energy::EnergyOptions missing;
  missing.nvml_library = "libtwobp-no-such-nvml.so";
  energy::OpenedMeter none = energy::open_nvml(0, missing);
  EXPECT_FALSE(none.meter);
  EXPECT_NE(none.note.find("cannot load libtwobp-no-such-nvml.so"), std::string::npos) << none.note;

  energy::OpenedMeter bad_index = energy::open_nvml(5, fake());
  EXPECT_FALSE(bad_index.meter);
  EXPECT_NE(bad_index.note.find("no NVML device 5: Invalid Argument"), std::string::npos) << bad_index.note;

  ::setenv("FAKE_NVML_NO_ENERGY", "1", 1);
  energy::OpenedMeter old_gpu = energy::open_nvml(0, fake());
  EXPECT_FALSE(old_gpu.meter);
  EXPECT_NE(old_gpu.note.find("no energy counter"), std::string::npos) << old_gpu.note;
  ::unsetenv("FAKE_NVML_NO_ENERGY");

  ::setenv("FAKE_NVML_INIT_FAILS", "1", 1);
  EXPECT_NE(energy::open_nvml(0, fake()).note.find("nvmlInit failed: Driver Not Loaded"), std::string::npos);
}

TEST(EnergyMeter, OtherDevicesHaveNone) {
  energy::OpenedMeter meta = energy::open_meter(c10::Device(c10::DeviceType::Meta));
  EXPECT_FALSE(meta.meter);
  EXPECT_NE(meta.note.find("no energy meter"), std::string::npos) << meta.note;
  // This machine's CPU: a meter or a reason, never an exception.
  energy::OpenedMeter cpu = energy::open_meter(kCpu);
  EXPECT_TRUE(cpu.meter || !cpu.note.empty());
}

// ---- a job's energy ----

TEST_F(PowercapTree, OneRankPerNodeReadsANodeWideMeter) {
  add({"intel-rapl:0", "package-0", 0, 1000000});
  energy::RankEnergy first(kCpu, /*first_on_node=*/true, options());
  energy::RankEnergy other(kCpu, /*first_on_node=*/false, options());
  EXPECT_EQ(first.source(), "rapl");
  set_energy("intel-rapl:0", 7000);
  EXPECT_DOUBLE_EQ(*first.share(), 7000e-6);
  EXPECT_DOUBLE_EQ(*other.share(), 0.0);  // measured by `first`

  energy::EnergyOptions none;
  none.powercap_root = root_ + "/nowhere";
  energy::RankEnergy unmeasured(kCpu, /*first_on_node=*/false, none);
  EXPECT_FALSE(unmeasured.share().has_value());
  EXPECT_EQ(unmeasured.source(), "");
  EXPECT_NE(unmeasured.note().find("absent"), std::string::npos);
}

TEST_F(PowercapTree, RankEnergyLetsTheNodesFirstRankReadTheCpuMeter) {
  add({"intel-rapl:0", "package-0", 0, 1000000});
  auto transports = make_local_transports(3);
  std::vector<energy::RankEnergy> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(energy::rank_energy(*transports[r], kCpu, options()));
  set_energy("intel-rapl:0", 9000);
  if (launch_env()) GTEST_SKIP() << "under a launcher the node's first rank is its local rank 0";
  EXPECT_DOUBLE_EQ(*ranks[0].share(), 9000e-6);  // whole: a CPU's meter is not divided among rank threads
  EXPECT_DOUBLE_EQ(*ranks[1].share(), 0.0);
  EXPECT_DOUBLE_EQ(*ranks[2].share(), 0.0);
}

TEST(JobEnergy, SumsSharesAndIsUnknownWhenOneIsMissing) {
  auto transports = make_local_transports(3);
  const Duration timeout = std::chrono::seconds(30);
  std::vector<std::optional<double>> all(3), some_missing(3);
  RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
    const int r = t.rank();
    if (!launch_env()) EXPECT_EQ(energy::first_rank_on_node(t), r == 0);  // threads of one process: one node
    all[r] = energy::job_energy(t, 1.5 * (r + 1), timeout);
    some_missing[r] = energy::job_energy(t, r == 2 ? std::nullopt : std::optional<double>(1.0), timeout);
  });
  ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(all[r].has_value());
    EXPECT_DOUBLE_EQ(*all[r], 9.0);
    EXPECT_FALSE(some_missing[r].has_value());
  }
}

// Under a launcher the node's first rank is the one with local rank 0, whatever its rank in the job.
TEST(JobEnergy, FirstOnNodeFollowsTheLaunchersLocalRank) {
  if (launch_env()) GTEST_SKIP() << "run under a launcher: its variables would be overwritten";
  auto transports = make_local_transports(1);
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  const bool second = energy::first_rank_on_node(*transports[0]);
  ::setenv("LOCAL_RANK", "0", 1);
  const bool first = energy::first_rank_on_node(*transports[0]);
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK"}) ::unsetenv(name);
  EXPECT_FALSE(second);
  EXPECT_TRUE(first);
  EXPECT_TRUE(energy::first_rank_on_node(*transports[0]));  // no launcher again: thread rank 0
}

}  // namespace
}  // namespace twobp::testing
