// Launch without MPI: the launch environment (torchrun, srun, mpirun variables) and StoreTransport, whose ranks
// meet at a c10d::TCPStore. The multi-process tests start real processes -- this executable again, with a
// torchrun-like environment -- and check their exit status; every wait is bounded, a stuck child is killed.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "common/spawn_ranks.h"
#include "transport/group_cases.h"
#include "transport/shard_cases.h"
#include "twobp/error.h"
#include "twobp/runtime/data_parallel.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/launch.h"
#include "twobp/transport/mpi.h"
#include "twobp/transport/store.h"

namespace twobp {
namespace {

constexpr Duration kStoreLong{30000};

// ---- launch environment ----

TEST(LaunchEnv, Torchrun) {
  auto l = launch_env_from({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                            {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29400"}});
  ASSERT_TRUE(l);
  EXPECT_EQ(l->launcher, "torchrun");
  EXPECT_EQ(l->rank, 3);
  EXPECT_EQ(l->world_size, 8);
  EXPECT_EQ(l->local_rank, 1);
  EXPECT_EQ(l->local_size, 2);
  EXPECT_EQ(l->master_addr, "node7");
  EXPECT_EQ(l->master_port, 29400);
  EXPECT_FALSE(l->agent_store);
  auto agent = launch_env_from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  ASSERT_TRUE(agent);
  EXPECT_TRUE(agent->agent_store) << "under torchrun rank 0 must connect to the agent's store, not serve one";
  EXPECT_EQ(agent->master_addr, "127.0.0.1");
}

TEST(LaunchEnv, SlurmOpenMpiPmiAndNone) {
  auto s = launch_env_from({{"SLURM_PROCID", "5"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "8"},
                            {"SLURM_LOCALID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                            {"SLURM_STEP_NUM_NODES", "2"}, {"MASTER_ADDR", "n1"}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->launcher, "slurm");
  EXPECT_EQ(s->rank, 5);
  EXPECT_EQ(s->world_size, 8);
  EXPECT_EQ(s->local_rank, 1);
  EXPECT_EQ(s->local_size, 4);
  EXPECT_EQ(s->master_addr, "n1");
  EXPECT_EQ(s->master_port, 29500);
  // Two nodes and no MASTER_ADDR: nobody can know where rank 0 is.
  auto s2 = launch_env_from({{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "8"},
                             {"SLURM_STEP_NUM_NODES", "2"}});
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->master_addr.empty());
  // One node: 127.0.0.1.
  auto s1 = launch_env_from({{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"},
                             {"SLURM_STEP_NUM_NODES", "1"}});
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->master_addr, "127.0.0.1");
  EXPECT_FALSE(launch_env_from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}})) << "an salloc shell is no launch";

  auto o = launch_env_from({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  ASSERT_TRUE(o);
  EXPECT_EQ(o->launcher, "openmpi");
  EXPECT_EQ(o->rank, 1);
  EXPECT_EQ(o->master_addr, "127.0.0.1");
  auto p = launch_env_from({{"PMI_RANK", "0"}, {"PMI_SIZE", "3"}});
  ASSERT_TRUE(p);
  EXPECT_EQ(p->launcher, "pmi");
  EXPECT_EQ(p->world_size, 3);
  EXPECT_FALSE(launch_env_from({{"HOME", "/root"}}));
}

// MPI launchers, from the same table launch_env_from() reads; on this process's environment too.
TEST(LaunchEnv, MpiLauncherDetection) {
  EXPECT_FALSE(mpi_launcher_in({{"HOME", "/root"}}));
  EXPECT_FALSE(mpi_launcher_in({{"RANK", "0"}, {"WORLD_SIZE", "2"}})) << "torchrun is no MPI launcher";
  EXPECT_FALSE(mpi_launcher_in({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}})) << "an salloc shell is no launch";
  EXPECT_TRUE(mpi_launcher_in({{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "4"}}));
  EXPECT_TRUE(mpi_launcher_in({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  EXPECT_TRUE(mpi_launcher_in({{"PMI_RANK", "0"}, {"PMI_SIZE", "3"}}));
  EXPECT_TRUE(mpi_launcher_in({{"PMIX_RANK", "0"}})) << "a PMIx server sets no world size variable";
  EXPECT_TRUE(mpi_launcher_in({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}}))
      << "torchrun's variables do not hide mpirun's";
  EXPECT_FALSE(mpi_launcher_in({{"OMPI_COMM_WORLD_RANK", ""}})) << "an empty variable is unset";

  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "SLURM_STEP_ID"}) {
    unsetenv(name);
  }
  EXPECT_FALSE(launched_by_mpi_launcher());
  setenv("PMIX_RANK", "0", 1);
  EXPECT_TRUE(launched_by_mpi_launcher());
  unsetenv("PMIX_RANK");
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  for (const auto& env : std::vector<std::map<std::string, std::string>>{
           {{"RANK", "x"}, {"WORLD_SIZE", "2"}},
           {{"RANK", "2"}, {"WORLD_SIZE", "2"}},
           {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
           {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}}) {
    EXPECT_THROW(launch_env_from(env), UsageError);
  }
  try {
    launch_env_from({{"RANK", "1"}, {"WORLD_SIZE", "two"}});
    ADD_FAILURE() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE='two'"), std::string::npos) << e.what();
  }
  // An MPI launcher's rank without its world size is a broken launch, not a plain process.
  try {
    launch_env_from({{"OMPI_COMM_WORLD_RANK", "1"}});
    ADD_FAILURE() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_SIZE is not set"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(launch_env_from({{"RANK", "1"}})) << "a lone RANK is not torchrun";
}

TEST(LaunchEnv, CudaDeviceChoice) {
  EXPECT_EQ(choose_cuda_device(3, 4, 4), 3);  // one node, four GPUs
  EXPECT_EQ(choose_cuda_device(3, 4, 1), 0);  // CUDA_VISIBLE_DEVICES per rank (Slurm's --gpus-per-task)
  EXPECT_EQ(choose_cuda_device(1, 2, 8), 1);
  EXPECT_THROW(choose_cuda_device(0, 1, 0), UsageError);
  EXPECT_THROW(choose_cuda_device(4, 6, 4), UsageError);  // more ranks than GPUs
}

// ---- processes ----

void expect_all_passed(const std::string& scenario, int world) {
  const auto codes = testing::run_processes("StoreTransportRank.Run", scenario, world);
  ASSERT_EQ(codes.size(), static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "scenario " << scenario << ", rank " << r;
}

TEST(StoreTransportProcesses, CollectivesRingAndErrors) { expect_all_passed("collectives", 3); }
TEST(StoreTransportProcesses, PipelineStepMatchesSingleProcess) { expect_all_passed("pipeline", 2); }
TEST(StoreTransportProcesses, TimeoutAndAbortNameThePeer) { expect_all_passed("abort", 2); }
TEST(StoreTransportProcesses, GroupsByParity) { expect_all_passed("groups_parity", 4); }
TEST(StoreTransportProcesses, GroupsByHalf) { expect_all_passed("groups_half", 4); }
TEST(StoreTransportProcesses, AsynchronousAllReduces) { expect_all_passed("async_all_reduce", 4); }
TEST(StoreTransportProcesses, PeerThatNeverSplitsTimesOut) { expect_all_passed("split_timeout", 4); }
TEST(StoreTransportProcesses, AbortInAGroupIsSeenByItsMembers) { expect_all_passed("group_abort", 4); }
// reduce_scatter_sum / all_gather (tests/transport/shard_cases.h): sizes, dtypes, the round trip bitwise equal to
// all_reduce_sum, async forms, a group of two, argument errors, and a size mismatch refused on every rank.
TEST(StoreTransportProcesses, ShardedCollectives) { expect_all_passed("shards", 4); }
TEST(StoreTransportProcesses, ReplicasAreToldTheActionAUserErrorEscapedFrom) {
  expect_all_passed("replica_user_error", 4);
}

// The hang report across processes: the ranks that are alive agree on one report through the store, which
// names a killed rank as not answering and a rank stuck in compute by its action (its process answers from the
// board's own thread). Each child writes the report it got to a file; all must be equal.
std::vector<std::string> hang_reports(const std::string& scenario, int world) {
  // std::filesystem is avoided here: the torch wheel's libtorch.so exports a copy of it that crashes when called.
  std::string pattern = ::testing::TempDir() + "/twobp_hang_XXXXXX";
  const char* made = ::mkdtemp(pattern.data());
  EXPECT_NE(made, nullptr) << "mkdtemp " << pattern;
  if (made == nullptr) return std::vector<std::string>(static_cast<std::size_t>(world));
  const std::string dir = made;
  const auto codes = testing::run_processes("StoreTransportRank.Run", scenario, world, std::chrono::seconds(60),
                                            [&](int) { return std::vector<std::string>{"TWOBP_TEST_OUT=" + dir}; });
  std::vector<std::string> reports;
  for (int r = 0; r < world; ++r) {
    const std::string file = dir + "/rank" + std::to_string(r) + ".txt";
    std::ifstream in(file);
    std::stringstream text;
    text << in.rdbuf();
    reports.push_back(text.str());
    std::remove(file.c_str());
    if (codes[r] != -9) EXPECT_EQ(codes[r], 0) << "scenario " << scenario << ", rank " << r;
  }
  ::rmdir(dir.c_str());
  return reports;
}

void expect_one_report(const std::vector<std::string>& reports, const std::vector<int>& ranks,
                       const std::string& verdict) {
  for (int r : ranks) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(reports[r], reports[ranks.front()]);
    EXPECT_NE(reports[r].substr(0, reports[r].find('\n')).find(verdict), std::string::npos) << reports[r];
  }
}

TEST(StoreTransportProcesses, AKilledRankIsNamedInOneHangReport) {
  const auto reports = hang_reports("hang_killed", 4);
  expect_one_report(reports, {0, 1, 2}, "rank 3 did not answer: it is dead");
  EXPECT_EQ(reports[3], "") << "rank 3 was killed before it could write";
}

TEST(StoreTransportProcesses, ARankStuckInComputeIsNamedInOneHangReport) {
  const auto reports = hang_reports("hang_compute", 4);
  expect_one_report(reports, {0, 1, 2, 3}, "rank 3 is computing F stage 3 micro-batch 1 for");
}

// dp 2 x pp 2: the replica that finished waits in the gradient reduction, the other in its pipeline; the report is
// the whole job's, by world rank (twobp/runtime/data_parallel.h).
TEST(StoreTransportProcesses, ARankStuckInOneReplicaIsNamedByWorldRankInOneHangReport) {
  const auto reports = hang_reports("hang_dp", 4);
  expect_one_report(reports, {0, 1, 2, 3}, "rank 3 is computing F stage 1 micro-batch 1 for");
  EXPECT_NE(reports[0].find(", 4 ranks): "), std::string::npos) << reports[0];
  EXPECT_NE(reports[0].find("for the data-parallel gradient reduction with ranks 3"), std::string::npos)
      << reports[0];
}

// ---- what each child process runs ----

void collectives(StoreTransport& t) {
  const int n = t.world_size(), me = t.rank();
  at::Tensor x = at::full({4}, static_cast<double>(me + 1), at::kDouble);
  t.all_reduce_sum(x, kStoreLong);
  EXPECT_TRUE(at::equal(x, at::full({4}, n * (n + 1) / 2.0, at::kDouble)));
  t.barrier(kStoreLong);
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  for (auto dtype : {at::kFloat, at::kLong, at::kBFloat16}) {
    for (int k = 0; k < 3; ++k) {  // the same tag three times: delivered in order
      at::Tensor out = at::arange(10, at::kFloat).add(me * 100 + k).to(dtype);
      at::Tensor in = at::empty({10}, dtype);
      auto r = t.irecv(in, {prev, 7, "RECV ring"});
      t.isend(out, {next, 7, "SEND ring"})->wait(kStoreLong);
      r->wait(kStoreLong);
      EXPECT_TRUE(at::equal(in, at::arange(10, at::kFloat).add(prev * 100 + k).to(dtype)));
    }
  }
  // A shape mismatch names both ranks and both shapes.
  if (me == 1) t.isend(at::zeros({3}), {0, 9, "SEND_F stage 1 micro-batch 0"})->wait(kStoreLong);
  if (me == 0) {
    at::Tensor in = at::empty({4});
    try {
      t.irecv(in, {1, 9, "RECV_F stage 2 micro-batch 0"})->wait(kStoreLong);
      ADD_FAILURE() << "expected UsageError";
    } catch (const UsageError& e) {
      const std::string what = e.what();
      for (const char* w : {"rank 0", "RECV_F stage 2 micro-batch 0", "rank 1", "[4] Float", "[3] Float"}) {
        EXPECT_NE(what.find(w), std::string::npos) << w << " not in: " << what;
      }
    }
  }
  t.barrier(kStoreLong);
}

void pipeline(std::shared_ptr<StoreTransport> t) {
  using namespace testing;
  Float64Default float64;
  const int m = 4;
  auto schedule = make_schedule("1f1b", ScheduleOptions{2, m, 1, BackwardMode::kSplit});
  torch::manual_seed(11);
  auto inputs = torch::randn({m * kMicroBatchSize, kDim}), targets = torch::randn({m * kMicroBatchSize, kDim});
  Reference ref = run_reference(2, m, inputs, targets);
  const int me = t->rank();
  auto module = make_chunk(me);
  PipelineOptions o;
  o.executor.timeout = kStoreLong;
  o.loss = mse;
  o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  Pipeline p(schedule, {{me, module, [raw = module.get(), me](const at::Tensor& x) { return run_chunk(*raw, me, x); }}},
             t, o);
  auto result = p.step(inputs, targets);
  if (me == 1) {
    ASSERT_EQ(result.losses.size(), static_cast<std::size_t>(m));
    for (int mb = 0; mb < m; ++mb) EXPECT_NEAR(result.losses[mb], ref.losses[mb], 1e-12);
  }
  auto got = module->named_parameters();
  for (const auto& item : ref.chunks[me]->named_parameters()) {
    EXPECT_LE((got[item.key()].grad() - item.value().grad()).abs().max().item<double>(), 1e-12) << item.key();
  }
  t->barrier(kStoreLong);
}

void abort_scenario(StoreTransport& t) {
  at::Tensor in = at::empty({2});
  if (t.rank() == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      t.irecv(in, {1, 1, "RECV_B stage 0 micro-batch 3"})->wait(Duration(300));
      ADD_FAILURE() << "expected TimeoutError";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("RECV_B stage 0 micro-batch 3 from rank 1"), std::string::npos)
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  }
  t.barrier(kStoreLong);
  if (t.rank() == 1) {
    t.abort("rank 1 failed: injected failure");
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    t.irecv(in, {1, 2, "RECV_B stage 0 micro-batch 4"})->wait(kStoreLong);
    ADD_FAILURE() << "expected TransportError";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 aborted: rank 1 failed: injected failure"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "an abort must be seen at once";
}

void shards(StoreTransport& t) {
  testing::check_reduce_scatter_all_gather(t, kStoreLong);
  testing::check_round_trip_matches_all_reduce(t, kStoreLong, /*bitwise=*/true);
  testing::check_async_shards(t, kStoreLong);
  auto pair = t.split(t.rank() % 2, t.rank(), kStoreLong);
  testing::check_async_shards(*pair, kStoreLong);
  testing::check_shard_argument_errors(t, kStoreLong);
  // Every rank reads every other's description: each one finds the mismatch, and the store stays usable.
  EXPECT_TRUE(testing::sharded_size_mismatch(t, kStoreLong, /*gather=*/false)) << "rank " << t.rank();
  EXPECT_TRUE(testing::sharded_size_mismatch(t, kStoreLong, /*gather=*/true)) << "rank " << t.rank();
  at::Tensor x = at::ones({3});
  t.all_reduce_sum(x, kStoreLong);
  EXPECT_TRUE(at::equal(x, at::full({3}, 4.0f)));
}

// dp 2 x pp 2, 1F1B without 2BP: world rank 3 (replica 1, pipeline rank 1) throws an exception of the user's own
// type from a gradient hook in its first B. It keeps its type there; world rank 1, its data-parallel peer waiting
// for it in the gradient reduction, must be told the type and the action. Store groups do not share aborts (an
// abort in a group fails its members only), so that is the Pipeline's abort of the replicas, not the executor's
// abort of the pipeline, that tells it.
struct ModelBug : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void replica_user_error(StoreTransport& t) {
  using namespace testing;
  Float64Default float64;
  const int m = 2;
  const Schedule schedule = make_schedule("1f1b", ScheduleOptions{2, m, 1, BackwardMode::kStandard});
  {
    ParallelGroups groups(t, 2, kStoreLong);
    const int stage = groups.pipeline_rank();
    auto module = make_chunk(stage);
    PipelineOptions o;
    o.executor.timeout = kStoreLong;
    o.loss = mse;
    o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
    o.data_parallel.group = groups.data_parallel();
    auto forward = [raw = module.get(), stage](const at::Tensor& x) { return run_chunk(*raw, stage, x); };
    Pipeline p(schedule, {{stage, module, forward}}, groups.pipeline(), o);
    if (t.rank() == 3) {
      p.parameters().front().register_hook([](const at::Tensor&) -> at::Tensor { throw ModelBug("bug"); });
    }
    torch::manual_seed(12);
    const at::Tensor inputs = torch::randn({m * kMicroBatchSize, kDim});
    const at::Tensor targets = torch::randn({m * kMicroBatchSize, kDim});
    try {
      p.step(inputs, targets);
      ADD_FAILURE() << "rank " << t.rank() << ": the step must fail";
    } catch (const ModelBug& e) {
      EXPECT_EQ(t.rank(), 3) << e.what();
    } catch (const std::exception& e) {
      EXPECT_NE(t.rank(), 3) << e.what();
      if (t.rank() == 1) {
        EXPECT_NE(std::string(e.what()).find("ModelBug): bug (in rank 1: B stage 1 micro-batch 0)"), std::string::npos)
            << e.what();
      }
    }
  }
  t.barrier(kStoreLong);  // the world transport (rank 0 serves the store) outlives every rank's reading of an abort
}

// 4 ranks, 1F1B; world rank 3 is killed at its first forward (hang_killed) or sleeps past the timeout in its
// second (hang_compute, hang_dp): over 4 stages, or as dp 2 x pp 2 (hang_dp: ParallelGroups over the store, 2
// stages; replica 0 then waits for it in the gradient reduction). Writes the hang report its error carried to
// $TWOBP_TEST_OUT/rank<r>.txt.
void hang_scenario(std::shared_ptr<StoreTransport> t, bool killed, int dp) {
  using namespace testing;
  Float64Default float64;
  const int m = 4, me = t->rank();
  ParallelGroups groups(*t, dp, kStoreLong);
  const int stage = groups.pipeline_rank();
  auto schedule = make_schedule("1f1b", ScheduleOptions{4 / dp, m, 1, BackwardMode::kSplit});
  torch::manual_seed(11);
  auto inputs = torch::randn({m * kMicroBatchSize, kDim}), targets = torch::randn({m * kMicroBatchSize, kDim});
  auto module = make_chunk(stage);
  PipelineOptions o;
  o.executor.timeout = Duration(1500);
  o.loss = mse;
  o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
  o.data_parallel.group = groups.data_parallel();  // null for dp 1
  auto calls = std::make_shared<int>(0);
  Pipeline p(schedule,
             {{stage, module,
               [raw = module.get(), me, stage, calls, killed](const at::Tensor& x) {
                 if (me == 3 && killed) ::raise(SIGKILL);
                 if (me == 3 && (*calls)++ == 1) std::this_thread::sleep_for(std::chrono::seconds(4));
                 return run_chunk(*raw, stage, x);
               }}},
             groups.pipeline(), o);
  std::string report;
  try {
    p.step(inputs, targets);
    ADD_FAILURE() << "the step should have failed";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const auto at = what.find("hang report (");
    EXPECT_NE(at, std::string::npos) << what;
    if (at != std::string::npos) report = what.substr(at);
  }
  const char* out = std::getenv("TWOBP_TEST_OUT");
  ASSERT_NE(out, nullptr);
  std::ofstream(std::string(out) + "/rank" + std::to_string(me) + ".txt") << report;
}

TEST(StoreTransportRank, Run) {
  const char* scenario = std::getenv("TWOBP_TEST_SCENARIO");
  if (scenario == nullptr) GTEST_SKIP() << "runs only as a child process of the StoreTransportProcesses tests";
  torch::set_num_threads(1);  // several ranks share the test machine's cores
  auto env = launch_env();
  ASSERT_TRUE(env) << "no launch environment";
  EXPECT_EQ(env->launcher, "torchrun");
  StoreOptions options;
  options.connect_timeout = kStoreLong;
  auto t = std::make_shared<StoreTransport>(*env, options);
  EXPECT_EQ(t->rank(), env->rank);
  EXPECT_EQ(t->pairing(), Pairing::kByTag);
  const std::string s = scenario;
  if (s == "collectives") collectives(*t);
  if (s == "pipeline") pipeline(t);
  if (s == "abort") abort_scenario(*t);
  if (s == "groups_parity") testing::check_groups(*t, testing::GroupLayout::kByParity, kStoreLong);
  if (s == "groups_half") testing::check_groups(*t, testing::GroupLayout::kByHalf, kStoreLong);
  if (s == "async_all_reduce") testing::check_async_all_reduce(*t, kStoreLong);
  if (s == "split_timeout") testing::check_split_timeout(*t, Duration(1000));
  if (s == "group_abort") testing::check_group_abort(*t, kStoreLong, /*reaches_other_groups=*/false);
  if (s == "replica_user_error") replica_user_error(*t);
  if (s == "shards") shards(*t);
  if (s == "hang_killed" || s == "hang_compute" || s == "hang_dp") {
    hang_scenario(t, s == "hang_killed", s == "hang_dp" ? 2 : 1);
  }
}

}  // namespace
}  // namespace twobp
