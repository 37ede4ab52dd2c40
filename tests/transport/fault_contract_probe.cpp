// One cell of the fault contract (driven by fault_contract.py): 2 steps of 1F1B with 2BP over 4 ranks, a fault
// injected into the sends through FaultInjectingTransport, each rank's gradients (and the last stage's losses)
// compared with one process computing the same steps. After each step the ranks also reduce-scatter and all-gather
// their flat gradients (ZeRO-2's collectives; the async forms on the second step) through the same wrappers, which
// must pass them untouched: the gathered sum is compared with the reference's too.
//
//   fault_contract_probe TRANSPORT FAULT
//     TRANSPORT  local-by-tag, local-in-order (4 rank threads in this process), store (this process is one rank of
//                a torchrun-like environment), mpi (one rank, under mpiexec)
//     FAULT      none, delay, reorder, duplicate, drop, fail-send, die, corrupt; a "+verify" suffix turns on
//                PipelineOptions::verify_messages (per-message checksums)
//
// Prints one line per rank of this process: "rank R: same result in S s", "rank R: DIFFERENT result: ...", or
// "rank R: error after S s: <message>". Exit status: 0 every rank here gave the reference result, 3 one gave a
// different result (the one outcome the contract forbids besides a hang), 1 one ended with an error.

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/config.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/transport/fault_injection.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/local.h"
#include "twobp/transport/store.h"
#if TWOBP_HAVE_MPI
#include "twobp/schedule/registry.h"
#include "twobp/transport/mpi.h"
#endif

namespace {

using namespace twobp;
using namespace twobp::testing;

constexpr int kRanks = 4, kMicroBatches = 8, kSteps = 2;
const Duration kTimeout{1500};

// The faults of the contract, each on the ranks, peers and messages of the Local suite (fault_injection_test).
std::optional<FaultOptions> fault_named(const std::string& name) {
  FaultOptions f;
  if (name == "none") return std::nullopt;
  if (name == "delay") {
    f.fault = Fault::kDelay;
    f.ranks = {1};
    f.delay = Duration(10);
  } else if (name == "reorder") {
    f.fault = Fault::kReorder;  // three activations held back 50 ms while later sends overtake them
    f.ranks = {0, 1, 2};
    f.label_contains = "SEND_F";
    f.max_faults = 3;
    f.delay = Duration(50);
  } else if (name == "duplicate") {
    f.fault = Fault::kDuplicate;
    f.ranks = {0};
    f.label_contains = "micro-batch 2";
    f.max_faults = 1;
  } else if (name == "drop") {
    f.fault = Fault::kDrop;
    f.ranks = {1};
    f.peer = 2;
    f.after_messages = 3;
  } else if (name == "fail-send") {
    f.fault = Fault::kFailSend;
    f.ranks = {2};
    f.after_messages = 5;
  } else if (name == "corrupt") {
    f.fault = Fault::kCorrupt;  // one bit of one activation
    f.ranks = {1};
    f.label_contains = "SEND_F";
    f.after_messages = 2;
    f.max_faults = 1;
  } else if (name == "die") {
    f.fault = Fault::kDie;
    f.ranks = {3};
    f.after_messages = 4;
  } else {
    throw UsageError("unknown fault '" + name + "'");
  }
  return f;
}

// What every rank needs, made on the main thread before any rank runs: the model's initialisers and the inputs
// draw from LibTorch's default generator, which rank threads would share.
struct Job {
  at::Tensor inputs, targets;
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;  // by rank
  std::vector<Reference> references;                       // each step in one process
  std::int64_t flat_size = 0;                              // of the flat gradient buffers (no multiple of kRanks)
  std::vector<at::Tensor> flat_sums;                       // each step: the references' flat gradients summed
};

std::int64_t parameter_count(torch::nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// The module's parameter gradients as one flat float64 buffer of n elements, zeros after them.
at::Tensor flat_grads(torch::nn::Module& m, std::int64_t n) {
  at::Tensor flat = at::zeros({n}, at::kDouble);
  std::int64_t offset = 0;
  for (const auto& p : m.parameters()) {
    if (p.grad().defined()) flat.narrow(0, offset, p.numel()).copy_(p.grad().reshape({-1}));
    offset += p.numel();
  }
  return flat;
}

Job make_job() {
  Job job;
  torch::manual_seed(3);
  job.inputs = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  job.targets = torch::randn({kMicroBatches * kMicroBatchSize, kDim});
  for (int r = 0; r < kRanks; ++r) {
    job.chunks.push_back(make_chunk(r));
    job.flat_size = std::max(job.flat_size, parameter_count(*job.chunks.back()));
  }
  if (job.flat_size % kRanks == 0) ++job.flat_size;  // unequal shards: the padded paths too
  for (int step = 0; step < kSteps; ++step) {
    job.references.push_back(run_reference(kRanks, kMicroBatches, job.inputs * (step + 1), job.targets));
    at::Tensor sum = at::zeros({job.flat_size}, at::kDouble);
    for (const auto& chunk : job.references.back().chunks) sum += flat_grads(*chunk, job.flat_size);
    job.flat_sums.push_back(sum);
  }
  return job;
}

// ZeRO-2's collectives over the pipeline's transport (the fault and checksum wrappers included), as a wait of the
// job: this rank's flat gradients reduce-scattered, the shards all-gathered (the async forms on odd steps). Empty
// when the gathered buffer is the references' sum.
std::string sharded_round_trip(Pipeline& p, torch::nn::Module& module, const Job& job, int step) {
  Transport& t = p.transport();
  const at::Tensor flat = flat_grads(module, job.flat_size);
  at::Tensor shard = at::empty({shard_range(job.flat_size, t.world_size(), t.rank()).size()}, at::kDouble);
  at::Tensor whole = at::empty({job.flat_size}, at::kDouble);
  p.run_collective(t, "the gradient shards' reduce-scatter and all-gather", [&] {
    if (step % 2 == 0) {
      t.reduce_scatter_sum(flat, shard, kTimeout);
      t.all_gather(shard, whole, kTimeout);
    } else {
      t.reduce_scatter_sum_async(flat, shard, kTimeout)->wait(kTimeout);
      t.all_gather_async(shard, whole, kTimeout)->wait(kTimeout);
    }
  });
  const double error = (whole - job.flat_sums[static_cast<std::size_t>(step)]).abs().max().item<double>();
  return error > 1e-12 ? fmt::format("step {}: the all-gathered gradient sum is off by {}", step, error) : "";
}

// Empty when this rank's step gave the reference's gradients (and, on the last stage, losses); else what differs.
std::string compare(int me, int step, const StepResult& result, torch::nn::Module& module, const Reference& ref) {
  if (me == kRanks - 1) {
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      if (result.losses.size() != static_cast<std::size_t>(kMicroBatches) ||
          std::abs(result.losses[mb] - ref.losses[mb]) > 1e-12) {
        return fmt::format("step {}: loss of micro-batch {}", step, mb);
      }
    }
  }
  auto got = module.named_parameters();
  for (const auto& item : ref.chunks[me]->named_parameters()) {
    const at::Tensor g = got[item.key()].grad();
    if (!g.defined() || (g - item.value().grad()).abs().max().item<double>() > 1e-12) {
      return fmt::format("step {}: gradient of {}", step, item.key());
    }
  }
  return "";
}

// Runs this rank's part; returns its line, and sets *different when it finished with another result.
std::string run_rank(std::shared_ptr<Transport> inner, const std::optional<FaultOptions>& fault, bool verify,
                     const Job& job, bool* different) {
  const int me = inner->rank();
  std::shared_ptr<Transport> transport =
      fault ? std::make_shared<FaultInjectingTransport>(inner, *fault) : std::move(inner);
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{kRanks, kMicroBatches, 1, BackwardMode::kSplit});
  const auto& module = job.chunks[me];
  PipelineOptions o;
  o.executor.timeout = kTimeout;
  o.verify_messages = verify;
  o.loss = mse;
  o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  Pipeline p(schedule, {{me, module, [raw = module.get(), me](const at::Tensor& x) { return run_chunk(*raw, me, x); }}},
             transport, o);
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::string diff;
  try {
    for (int step = 0; step < kSteps; ++step) {  // every step, so that the other ranks do not wait for this one
      p.zero_grad();
      const StepResult result = p.step(job.inputs * (step + 1), job.targets);  // other inputs every step
      if (diff.empty()) diff = compare(me, step, result, *module, job.references[step]);
      const std::string shards = sharded_round_trip(p, *module, job, step);  // every rank, whatever it found
      if (diff.empty()) diff = shards;
    }
  } catch (const std::exception& e) {
    return fmt::format("rank {}: error after {:.1f} s: {}", me, seconds(), e.what());
  }
  if (!diff.empty()) {
    *different = true;
    return fmt::format("rank {}: DIFFERENT result ({})", me, diff);
  }
  return fmt::format("rank {}: same result in {:.1f} s", me, seconds());
}

int run_main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fault_contract_probe local-by-tag|local-in-order|store|mpi FAULT[+verify]\n");
    return 2;
  }
  const std::string kind = argv[1];
  std::string fault_name = argv[2];
  const std::string suffix = "+verify";
  const bool verify = fault_name.size() > suffix.size() &&
                      fault_name.compare(fault_name.size() - suffix.size(), suffix.size(), suffix) == 0;
  if (verify) fault_name.resize(fault_name.size() - suffix.size());
  const auto fault = fault_named(fault_name);
  torch::set_num_threads(1);
  Float64Default float64;  // for the whole process: rank threads must not set and reset it
  const Job job = make_job();
  std::vector<std::string> lines(kRanks);
  std::vector<int> status(kRanks, -1);
  auto record = [&](int r, const std::string& line, bool different) {
    lines[r] = line;
    status[r] = different ? 3 : line.find(": same result") != std::string::npos ? 0 : 1;
  };
#if TWOBP_HAVE_MPI
  std::unique_ptr<MpiEnvironment> mpi;
#endif
  if (kind == "local-by-tag" || kind == "local-in-order") {
    LocalOptions local;
    local.pairing = kind == "local-by-tag" ? Pairing::kByTag : Pairing::kInOrderPerChannel;
    auto locals = make_local_transports(kRanks, local);
    std::vector<std::shared_ptr<Transport>> shared;
    for (auto& t : locals) shared.emplace_back(std::move(t));
    std::vector<Transport*> raw;
    for (auto& t : shared) raw.push_back(t.get());
    std::mutex mutex;
    run_rank_threads(raw, [&](Transport& t) {
      bool different = false;
      const std::string line = run_rank(shared[t.rank()], fault, verify, job, &different);
      std::lock_guard<std::mutex> lock(mutex);
      record(t.rank(), line, different);
    });
  } else if (kind == "store") {
    const auto env = launch_env();
    if (!env) {
      std::fprintf(stderr, "fault_contract_probe store: no launch environment (RANK, WORLD_SIZE, MASTER_ADDR...)\n");
      return 2;
    }
    bool different = false;
    auto store = std::make_shared<StoreTransport>(*env, StoreOptions{});
    record(env->rank, run_rank(store, fault, verify, job, &different), different);
#if TWOBP_HAVE_MPI
  } else if (kind == "mpi") {
    mpi = std::make_unique<MpiEnvironment>(&argc, &argv);  // finalized when run_main returns
    bool different = false;
    record(mpi->rank(), run_rank(std::make_shared<MpiTransport>(*mpi), fault, verify, job, &different), different);
#endif
  } else {
    std::fprintf(stderr, "fault_contract_probe: unknown transport '%s'\n", kind.c_str());
    return 2;
  }
  int exit_status = 0;
  for (int r = 0; r < kRanks; ++r) {
    if (status[r] < 0) continue;
    std::printf("%s\n", lines[r].c_str());
    if (status[r] == 3) exit_status = 3;
    if (status[r] == 1 && exit_status == 0) exit_status = 1;
  }
  std::fflush(stdout);
  return exit_status;
}

}  // namespace

int main(int argc, char** argv) { twobp::exit_without_teardown(run_main(argc, argv)); }
