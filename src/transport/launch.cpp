// Launch environment detection (see twobp/transport/launch.h).

#include "twobp/transport/launch.h"

#include <cstdlib>
#include <string>

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

}  // namespace

std::optional<LaunchEnv> launch_env_from(const Env& env) {
  LaunchEnv l;
  bool single_node = false;
  if (find(env, "RANK") && find(env, "WORLD_SIZE")) {
    l.launcher = "torchrun";
    l.rank = number(env, "RANK");
    l.world_size = number(env, "WORLD_SIZE");
    l.local_rank = number_or(env, "LOCAL_RANK", 0);
    l.local_size = number_or(env, "LOCAL_WORLD_SIZE", l.world_size);
    single_node = l.local_size == l.world_size;
    const std::string* agent = find(env, "TORCHELASTIC_USE_AGENT_STORE");
    l.agent_store = agent != nullptr && (*agent == "True" || *agent == "true" || *agent == "1");
  } else if (find(env, "SLURM_PROCID") && find(env, "SLURM_STEP_ID")) {
    l.launcher = "slurm";
    l.rank = number(env, "SLURM_PROCID");
    l.world_size = number(env, "SLURM_NTASKS");
    l.local_rank = number_or(env, "SLURM_LOCALID", 0);
    // "4(x2)" = 4 tasks on each of 2 nodes; the first number is this step's tasks on the first node(s).
    l.local_size = number_or(env, "SLURM_STEP_TASKS_PER_NODE", l.world_size, /*leading_only=*/true);
    single_node = number_or(env, "SLURM_STEP_NUM_NODES", number_or(env, "SLURM_NNODES", 0)) == 1;
  } else if (find(env, "OMPI_COMM_WORLD_RANK")) {
    l.launcher = "openmpi";
    l.rank = number(env, "OMPI_COMM_WORLD_RANK");
    l.world_size = number(env, "OMPI_COMM_WORLD_SIZE");
    l.local_rank = number_or(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    l.local_size = number_or(env, "OMPI_COMM_WORLD_LOCAL_SIZE", l.world_size);
    single_node = l.local_size == l.world_size;
  } else if (find(env, "PMI_RANK") && find(env, "PMI_SIZE")) {
    l.launcher = "pmi";
    l.rank = number(env, "PMI_RANK");
    l.world_size = number(env, "PMI_SIZE");
    l.local_rank = number_or(env, "MPI_LOCALRANKID", 0);
    l.local_size = number_or(env, "MPI_LOCALNRANKS", l.world_size);
    single_node = l.local_size == l.world_size;
  } else {
    return std::nullopt;
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

std::optional<LaunchEnv> launch_env() {
  Env env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq != std::string::npos) env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return launch_env_from(env);
}

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
