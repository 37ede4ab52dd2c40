// Launch environment detection (see twobp/transport/launch.h).

#include "twobp/transport/launch.h"

#include <cstdlib>
#include <string>

#include "twobp/transport/mpi.h"
#include "util/check.h"

extern char** environ;

namespace twobp {
namespace {

using Env = std::map<std::string, std::string>;

const std::string* find(const Env& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

/// Parses the leading integer of a variable ("4(x2)" in SLURM_STEP_TASKS_PER_NODE reads as 4).
int number(const Env& env, const char* name, bool leading_only = false) {
  const std::string* value = find(env, name);
  TWOBP_CHECK(value != nullptr, UsageError, "launch environment: {} is not set", name);
  std::size_t used = 0;
  long parsed = -1;
  try {
    parsed = std::stol(*value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TWOBP_CHECK(used > 0 && (leading_only || used == value->size()) && parsed >= 0 && parsed < (1L << 24),
              UsageError, "launch environment: {}='{}' is not a non-negative number", name, *value);
  return static_cast<int>(parsed);
}

int number_or(const Env& env, const char* name, int fallback, bool leading_only = false) {
  return find(env, name) ? number(env, name, leading_only) : fallback;
}

// Every launcher's variables, in the order launch_env_from() tries them: the one table of launcher variables
// (launched_by_mpi_launcher() reads it too).
struct Launcher {
  const char* name;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_size;
  const char* started_by;  ///< also required: set by the launcher that starts the processes (nullptr: none)
  bool mpi;                ///< an MPI launcher (MPI_Init finds its world)
};
constexpr Launcher kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", nullptr, false},
    // SLURM_STEP_ID: set by srun, not in a plain salloc shell (which has SLURM_NTASKS and SLURM_PROCID too).
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_ID", true},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr, true},
    // MPICH/Hydra and Intel MPI.
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", nullptr, true},
};
// A PMIx server (Open MPI 5's prterun, srun --mpi=pmix) gives every process its rank here; the world size comes
// from PMIx itself, so this alone tells an MPI launch, not the layout.
constexpr const char* kPmixRank = "PMIX_RANK";

bool started_by(const Env& env, const Launcher& k) {
  return find(env, k.rank) && (k.started_by == nullptr || find(env, k.started_by));
}

Env process_env() {
  Env env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq != std::string::npos) env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return env;
}

}  // namespace

bool mpi_launcher_in(const Env& env) {
  for (const Launcher& k : kLaunchers) {
    if (k.mpi && started_by(env, k)) return true;
  }
  return find(env, kPmixRank) != nullptr;
}

std::optional<LaunchEnv> launch_env_from(const Env& env) {
  const Launcher* k = nullptr;
  for (const Launcher& candidate : kLaunchers) {
    if (!started_by(env, candidate)) continue;
    // An MPI launcher's rank without its world size is a broken environment (number() says which variable is
    // missing); a lone RANK is a common name for other things, so torchrun needs WORLD_SIZE as well.
    if (find(env, candidate.world_size) || candidate.mpi) {
      k = &candidate;
      break;
    }
  }
  if (k == nullptr) return std::nullopt;
  LaunchEnv l;
  l.launcher = k->name;
  l.rank = number(env, k->rank);
  l.world_size = number(env, k->world_size);
  l.local_rank = number_or(env, k->local_rank, 0);
  // Slurm's "4(x2)" = 4 tasks on each of 2 nodes; the first number is this step's tasks on the first node(s).
  l.local_size = number_or(env, k->local_size, l.world_size, /*leading_only=*/l.launcher == "slurm");
  bool single_node = l.local_size == l.world_size;
  if (l.launcher == "slurm") {
    single_node = number_or(env, "SLURM_STEP_NUM_NODES", number_or(env, "SLURM_NNODES", 0)) == 1;
  } else if (l.launcher == "torchrun") {
    const std::string* agent = find(env, "TORCHELASTIC_USE_AGENT_STORE");
    l.agent_store = agent != nullptr && (*agent == "True" || *agent == "true" || *agent == "1");
  }
  TWOBP_CHECK(l.world_size >= 1 && l.rank < l.world_size, UsageError,
              "launch environment ({}): rank {} is not below the world size {}", l.launcher, l.rank, l.world_size);
  TWOBP_CHECK(l.local_size >= 1 && l.local_rank < l.local_size && l.local_size <= l.world_size, UsageError,
              "launch environment ({}): local rank {} of local size {} does not fit world size {}", l.launcher,
              l.local_rank, l.local_size, l.world_size);
  if (const std::string* addr = find(env, "MASTER_ADDR")) {
    l.master_addr = *addr;
  } else if (single_node) {
    l.master_addr = "127.0.0.1";
  }
  l.master_port = number_or(env, "MASTER_PORT", single_node || !l.master_addr.empty() ? 29500 : 0);
  TWOBP_CHECK(l.master_port < 65536, UsageError, "launch environment: MASTER_PORT={} is not a TCP port",
              l.master_port);
  return l;
}

std::optional<LaunchEnv> launch_env() { return launch_env_from(process_env()); }

// Declared in twobp/transport/mpi.h (it is part of every build, with or without MPI).
bool launched_by_mpi_launcher() { return mpi_launcher_in(process_env()); }

int choose_cuda_device(int local_rank, int local_size, int device_count) {
  TWOBP_CHECK(device_count >= 1, UsageError, "local rank {}: no CUDA device is visible", local_rank);
  if (device_count == 1) return 0;  // one device per rank (CUDA_VISIBLE_DEVICES per rank), or a one-GPU node
  TWOBP_CHECK(local_size <= device_count, UsageError,
              "local rank {}: {} ranks on this node but {} CUDA devices: run at most one rank per GPU, or give each "
              "rank its own device with CUDA_VISIBLE_DEVICES",
              local_rank, local_size, device_count);
  return local_rank;
}

}  // namespace twobp
