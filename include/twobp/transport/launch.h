#pragma once
// Who am I in the job? Ranks come from the environment a launcher sets: torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...) or
// mpirun (OMPI_COMM_WORLD_*, PMI_*). Compiled in every build: a program without MPI support still runs under any
// of them, rendezvousing through a c10d::TCPStore (StoreTransport, store.h) at MASTER_ADDR:MASTER_PORT.

#include <map>
#include <optional>
#include <string>

namespace twobp {

struct LaunchEnv {
  std::string launcher;  ///< "torchrun", "slurm", "openmpi" or "pmi" (MPICH/Hydra, Intel MPI)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  ///< rank among the processes on this node
  int local_size = 1;
  /// Where rank 0 serves the TCPStore. MASTER_ADDR/MASTER_PORT when set; otherwise 127.0.0.1 and 29500 when
  /// the job is known to be on one node, else empty / 0 (make_store() then says what to set).
  std::string master_addr;
  int master_port = 0;
  /// torchrun's agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
  /// rank 0 then connects to it like every other rank instead of serving one.
  bool agent_store = false;
};

/// Reads the launcher's variables from `env` (name -> value; tests pass their own), in this order: torchrun's
/// RANK/WORLD_SIZE, Slurm's SLURM_PROCID with SLURM_STEP_ID (set by srun, not by a plain salloc shell), Open
/// MPI's OMPI_COMM_WORLD_RANK, then PMI_RANK/PMI_SIZE. Returns nullopt when none is present (a plain process).
/// Throws UsageError naming the variable when a value is not a number or out of range (rank >= world size...).
std::optional<LaunchEnv> launch_env_from(const std::map<std::string, std::string>& env);

/// launch_env_from() on this process's environment.
std::optional<LaunchEnv> launch_env();

/// Whether `env` is that of a process an MPI launcher started: srun (SLURM_PROCID with SLURM_STEP_ID), Open MPI's
/// mpirun (OMPI_COMM_WORLD_RANK), MPICH/Hydra or Intel MPI (PMI_RANK), or a PMIx server (PMIX_RANK) -- whatever
/// else is set (torchrun's RANK does not hide them). launched_by_mpi_launcher() (transport/mpi.h) asks it of this
/// process. The variables are those launch_env_from() reads, from one table.
bool mpi_launcher_in(const std::map<std::string, std::string>& env);

/// The CUDA device of a rank: local_rank when the node's ranks see several devices (one each), 0 when each rank
/// sees exactly one (CUDA_VISIBLE_DEVICES set per rank, Slurm's --gpus-per-task). Throws UsageError when there
/// is no device, or when local_size > device_count > 1 (two ranks would share a device by accident).
int choose_cuda_device(int local_rank, int local_size, int device_count);

}  // namespace twobp
