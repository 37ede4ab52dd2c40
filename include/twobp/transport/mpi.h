#pragma once
// MPI support: the process environment (MpiEnvironment) and MpiTransport, which moves CPU tensors between
// processes. launched_by_mpi_launcher() is available in every build so that a program can choose between
// LocalTransport and MPI (and say clearly when it was started by mpirun but built without MPI).
//
// <mpi.h> is deliberately not included here: the MPI handles live in the .cpp files.

#include <memory>
#include <string>

#include "twobp/config.h"
#include "twobp/transport/transport.h"

namespace twobp {

/// True when this process was started by an MPI launcher (mpirun/mpiexec of Open MPI or MPICH/Hydra, srun, a PMIx
/// server): mpi_launcher_in() (twobp/transport/launch.h, which lists the variables) on this process's environment.
/// A plain `salloc` shell is not one (it has SLURM_NTASKS and SLURM_PROCID but no SLURM_STEP_ID).
bool launched_by_mpi_launcher();

#if TWOBP_HAVE_MPI

/// RAII owner of MPI initialization. Construct one in main() before any MPI transport, destroy it after them.
///
/// Calls MPI_Init_thread requesting MPI_THREAD_MULTIPLE unless MPI is already initialized (then it adopts the
/// existing state and never finalizes). With a lower thread level the transports still work when each is used
/// from one thread at a time (MpiTransport serializes its MPI calls then); thread_multiple() tells which.
/// Finalizes MPI in the destructor only if this object initialized it.
class MpiEnvironment {
 public:
  MpiEnvironment();
  MpiEnvironment(int* argc, char*** argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /// Rank among the processes on this node (MPI_COMM_TYPE_SHARED), for choosing the GPU.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  /// Thread level MPI provided (MPI_THREAD_SINGLE..MPI_THREAD_MULTIPLE as an int).
  int thread_level() const { return thread_level_; }
  bool thread_multiple() const;
  bool initialized_here() const { return initialized_here_; }

 private:
  void init(int* argc, char*** argv);

  int rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  int thread_level_ = 0;
  bool initialized_here_ = false;
};

/// Moves CPU tensors between MPI processes over a private duplicate of MPI_COMM_WORLD.
///
/// Wire format: each message is a fixed 96-byte header (sender, tag, dtype, ndim, dims[<=8], numel) sent
/// with MPI tag 2*t and the payload with 2*t+1, where t is the logical tag folded into MPI_TAG_UB; the header
/// carries the full 64-bit tag, so a collision of folded tags is detected (TransportError) instead of silently
/// delivering the wrong tensor. Payloads are limited to INT_MAX bytes (2 GiB).
///
/// irecv posts both receives at once (the payload straight into the caller's buffer); wait() polls MPI_Test
/// until done or the deadline, then checks the header against the buffer: UsageError naming both ranks, the
/// label, expected and actual shape/dtype. On a timeout the pending requests are cancelled where MPI allows;
/// what cannot be cancelled is parked (buffers kept alive) and reaped later, so nothing is freed under MPI.
///
/// all_reduce_sum uses MPI_Iallreduce (all_reduce_sum_async returns it unfinished, progressed by the progress
/// thread meanwhile), barrier MPI_Ibarrier, both polled with a timeout. A timed-out collective
/// cannot be cancelled in MPI: later collectives on this transport throw TransportError.
///
/// all_reduce_sum takes any number of elements up to INT_MAX (half/bfloat16 are summed in float32); the
/// summation order is the MPI library's (deterministic for a fixed job layout in Open MPI and MPICH, but not
/// rank order). broadcast uses MPI_Ibcast on the bytes (any dtype, up to INT_MAX bytes), polled with a timeout.
/// reduce_scatter_sum uses MPI_Ireduce_scatter (dtypes and summation order as all_reduce_sum), all_gather
/// MPI_Iallgatherv on the bytes (any dtype); their async forms return them unfinished, like all_reduce_sum_async.
/// MPI cannot compare the ranks' tensors within the collective: the first call of each also runs one small
/// blocking all-reduce of every rank's (collective, n, dtype) and raises UsageError on every rank when they differ;
/// later calls are not compared (a rank passing another n then gets MPI's error, a timeout or a wrong result).
/// split(color, key, timeout): a timed gathering all_reduce_sum, then MPI_Comm_split of this transport's
/// communicator (which can no longer wait for an absent rank); the group is an MpiTransport on its own
/// communicator (its own progress thread), so its messages never match the parent's. abort() in a group still
/// ends the whole job. The group's communicator is freed by its destructor: destroy groups before the
/// MpiEnvironment (before the parent is the safe habit).
///
/// abort(reason) prints the reason with the rank to stderr and calls MPI_Abort(MPI_COMM_WORLD, 1): THE WHOLE
/// JOB DIES; it does not return.
///
/// Threading: one transport per process. With MPI_THREAD_MULTIPLE several threads may use it; otherwise its
/// MPI calls are serialized by a mutex, which is enough under MPI_THREAD_SERIALIZED (under FUNNELED/SINGLE use
/// it only from the thread that initialized MPI).
class MpiTransport final : public Transport {
 public:
  /// Collective over MPI_COMM_WORLD (duplicates it). `env` must outlive the transport.
  explicit MpiTransport(const MpiEnvironment& env);
  ~MpiTransport() override;

  int rank() const override;
  int world_size() const override;
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string name() const override { return "mpi"; }
  /// With MPI_THREAD_MULTIPLE: over a communicator of its own, answered by a watcher thread; else null.
  std::shared_ptr<StatusBoard> status_board() const override;
  Pairing pairing() const override { return pairing_of("mpi"); }

  std::unique_ptr<Work> isend(const at::Tensor& tensor, const P2POptions& options) override;
  std::unique_ptr<Work> irecv(at::Tensor& buffer, const P2POptions& options) override;
  void all_reduce_sum(at::Tensor& tensor, Duration timeout) override;
  std::unique_ptr<Work> all_reduce_sum_async(at::Tensor& tensor, Duration timeout) override;
  bool asynchronous_all_reduce() const override { return true; }
  void reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) override;
  std::unique_ptr<Work> reduce_scatter_sum_async(const at::Tensor& input, at::Tensor& output,
                                                 Duration timeout) override;
  void all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) override;
  std::unique_ptr<Work> all_gather_async(const at::Tensor& shard, at::Tensor& output, Duration timeout) override;
  bool asynchronous_sharded_collectives() const override { return true; }
  void barrier(Duration timeout) override;
  void broadcast(at::Tensor& tensor, int root, Duration timeout) override;
  std::unique_ptr<Transport> split(int color, int key, Duration timeout) override;
  [[noreturn]] void abort(const std::string& reason) override;

  struct Impl;

 private:
  explicit MpiTransport(std::shared_ptr<Impl> impl);  // a group made by split()
  std::shared_ptr<Impl> impl_;
};

#endif  // TWOBP_HAVE_MPI

}  // namespace twobp
