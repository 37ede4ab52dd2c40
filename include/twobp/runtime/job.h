#pragma once
// A job's ranks, however they were started, for a program's main(): under an MPI launcher in a build with MPI every
// process is one rank (MpiEnvironment); under torchrun or srun -- or mpirun in a build without MPI -- the ranks come
// from the launcher's environment (launch_env) and meet at a TCPStore (StoreTransport); GPUs then talk over NCCL.
// Otherwise the ranks run as threads of this process over Local transports.
//
//   twobp::Job job(&argc, &argv, /*thread_ranks=*/4, /*cuda=*/false);
//   twobp::run_ranks(job.run_options(), [&](twobp::Transport& t) { ... });
//
// Header-only, like runtime/mpi_launch.h: it calls MPI and NCCL only where the build has them (twobp/config.h), so
// that a program linking those components compiles it and the core never calls them.

#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "twobp/config.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/mpi_launch.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/mpi.h"
#include "twobp/transport/store.h"
#if TWOBP_HAVE_NCCL
#include "twobp/transport/nccl.h"
#endif

namespace twobp {

class Job {
 public:
  /// Reads how this process was started (and initializes MPI under an MPI launcher: `argc`, `argv` as MPI_Init
  /// takes them). `thread_ranks`: the ranks when no launcher started it; `cuda`: ranks compute on GPUs (processes
  /// then talk over NCCL; thread ranks' messages stay on GPU r mod the device count).
  Job(int* argc, char*** argv, int thread_ranks, bool cuda)
      : mpi_(TWOBP_HAVE_MPI && launched_by_mpi_launcher()),
        launch_(mpi_ ? std::nullopt : launch_env()),
        cuda_(cuda),
        thread_ranks_(thread_ranks) {
#if TWOBP_HAVE_MPI
    if (mpi_) {
      env_ = std::make_unique<MpiEnvironment>(argc, argv);
      launch_ = mpi_launch_env(*env_);
    }
#endif
  }

  /// Whether the ranks are processes (a launcher started this one) rather than threads.
  bool processes() const { return launch_.has_value(); }
  int world_size() const { return processes() ? launch_->world_size : thread_ranks_; }
  /// This process's rank (0 with thread ranks: the process runs them all).
  int rank() const { return processes() ? launch_->rank : 0; }
  /// "MPI", "processes, torchrun + TCPStore" or "threads".
  std::string how() const {
    return mpi_ ? "MPI" : processes() ? "processes, " + launch_->launcher + " + TCPStore" : "threads";
  }
  /// The ranks sharing this node's cores: this process's threads, or the launcher's processes on the node.
  int ranks_on_node() const { return processes() ? launch_->local_size : thread_ranks_; }
  /// Gives each of this node's ranks its share of the cores (torch::set_num_threads), so that they do not
  /// oversubscribe the node ranks_on_node() times.
  void share_cores() const {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    at::set_num_threads(std::max(1, cores / std::max(1, ranks_on_node())));
  }

  /// NcclOptions::stream_waits for the NCCL transports this job builds (processes with `cuda`): receives waited on
  /// the compute stream, a watchdog thread for their timeouts. Off by default; no effect on other transports.
  void set_nccl_stream_waits(bool on) { nccl_stream_waits_ = on; }
  bool nccl_stream_waits() const { return nccl_stream_waits_; }

  /// Where a rank computes: where its transport's wire is (NCCL), else with `cuda` on GPU rank mod the devices (thread
  /// ranks share the GPUs), else the CPU.
  c10::Device device_of(Transport& transport) const {
    if (transport.device().is_cuda()) return transport.device();
    if (!cuda_ || processes()) return c10::Device(c10::kCPU);
    return c10::Device(c10::kCUDA, transport.rank() % std::max(1, static_cast<int>(torch::cuda::device_count())));
  }

  /// What run_ranks needs: thread ranks on Local transports (on GPUs with `cuda`: rank r's on GPU r mod the
  /// devices); processes on MPI (NCCL with `cuda`), or the TCPStore that rank 0 serves (NCCL over it with `cuda`;
  /// without NCCL in the build: UsageError on the first rank's start).
  RunRanksOptions run_options() const {
    RunRanksOptions o;
    o.thread_ranks = thread_ranks_;
    if (cuda_ && !processes()) {
      const int gpus = static_cast<int>(torch::cuda::device_count());
      for (int r = 0; r < thread_ranks_; ++r) o.local.devices.emplace_back(c10::kCUDA, r % std::max(1, gpus));
    }
    if (mpi_) o.launch = launch_;
    const bool cuda = cuda_;
    [[maybe_unused]] const bool stream_waits = nccl_stream_waits_;
#if TWOBP_HAVE_MPI
    MpiEnvironment* env = env_.get();
#endif
    o.process_transport = [=](const LaunchEnv& l) -> std::shared_ptr<Transport> {
#if TWOBP_HAVE_MPI
      if (env != nullptr) {
#if TWOBP_HAVE_NCCL
        if (cuda) {
          NcclOptions nccl;
          nccl.stream_waits = stream_waits;
          return std::make_shared<NcclTransport>(*env, nccl);
        }
#endif
        return mpi_process_transport(*env)(l);
      }
#endif
      auto host = std::make_shared<StoreTransport>(l);
      if (!cuda) return host;
#if TWOBP_HAVE_NCCL
      NcclOptions nccl;
      nccl.local_rank = l.local_rank;
      nccl.local_size = l.local_size;
      nccl.stream_waits = stream_waits;
      return std::make_shared<NcclTransport>(host, nccl);
#else
      throw UsageError("GPUs across processes need the NCCL transport, which this build of twobp does not have");
#endif
    };
    return o;
  }

 private:
  bool mpi_;
  std::optional<LaunchEnv> launch_;
  bool cuda_;
  int thread_ranks_;
  bool nccl_stream_waits_ = false;
#if TWOBP_HAVE_MPI
  std::unique_ptr<MpiEnvironment> env_;
#endif
};

}  // namespace twobp
