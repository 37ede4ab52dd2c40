// Detection of an MPI launcher from the environment. Compiled in every build (also without MPI), so that a
// program started by mpirun can report "built without MPI" instead of silently running N independent copies.

#include <cstdlib>

#include "twobp/transport/mpi.h"

namespace twobp {

namespace {
bool has_env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0';
}
}  // namespace

bool launched_by_mpi_launcher() {
  // Open MPI's mpirun, PMIx-based launchers (Open MPI 5, srun --mpi=pmix), MPICH/Hydra and Intel MPI (PMI),
  // MPICH's MPI_LOCALNRANKS. A Slurm allocation shell also has SLURM_NTASKS, so for Slurm require a task id.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (has_env(name)) return true;
  }
  return has_env("SLURM_NTASKS") && has_env("SLURM_PROCID") && has_env("SLURM_STEP_ID");
}

}  // namespace twobp
