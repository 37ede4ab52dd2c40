#pragma once
// Multi-process tests without MPI: the test executable starts copies of itself as the ranks of a job, with the
// environment torchrun would give them, and checks their exit codes. Bounded: a stuck child is killed (after a
// debugger has printed its threads' stacks, when TWOBP_TEST_STACKS_ON_HANG=1 and cuda-gdb or gdb is found).

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace twobp::testing {

/// A TCP port on 127.0.0.1 that was free a moment ago (0 if none could be found), taken from the 12,000 ports below
/// the kernel's ephemeral range (ip_local_port_range): a port the kernel hands out by itself -- to mpiexec's daemons,
/// to any connect() -- could be taken between this check and the store's bind, and a store client that reaches
/// such a listener retries for minutes (seen with an MPI job beside a store job); ports below the range are only
/// ever taken on purpose.
inline int free_port() {
  int low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  const int first = std::max(1024, low - 12000), count = std::max(1, low - first);
  std::random_device seed;
  std::mt19937 pick(seed());
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int port = first + static_cast<int>(pick() % static_cast<unsigned>(count));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return 0;
}

/// For a child rank's first line: its stdout line-buffered, so that what it printed survives a SIGKILL (gtest and
/// NCCL write to stdout, which is fully buffered into a file or pipe).
inline void line_buffered_output() { std::setvbuf(stdout, nullptr, _IOLBF, 0); }

/// Prints the threads' stacks of a stuck process (bounded: 40 s) when TWOBP_TEST_STACKS_ON_HANG=1 and cuda-gdb or
/// gdb is on the PATH -- the one look inside a hang that a single run on a lent GPU machine gets.
inline void print_stacks(pid_t pid) {
  const char* want = std::getenv("TWOBP_TEST_STACKS_ON_HANG");
  if (want == nullptr || std::string(want) != "1") return;
  const std::string cmd =
      "d=$(command -v cuda-gdb || command -v gdb) || { echo 'no debugger for the stacks'; exit 0; }; "
      "echo \"===== stacks of stuck rank process " + std::to_string(pid) + " ($d)\"; "
      "timeout -s KILL 40 \"$d\" -q -batch -p " + std::to_string(pid) +
      " -ex 'thread apply all bt 30' 2>&1 | grep -v '^\\[New LWP' | head -400";
  std::fflush(stdout);
  std::fflush(stderr);
  std::string sh = "/bin/sh", flag = "-c", command = cmd;
  std::vector<char*> argv{sh.data(), flag.data(), command.data(), nullptr};
  pid_t dbg = 0;
  if (posix_spawn(&dbg, "/bin/sh", nullptr, nullptr, argv.data(), environ) == 0) waitpid(dbg, nullptr, 0);
}

/// Starts `world` copies of this executable, each running only the test `test` (a gtest filter) with a
/// torchrun-like environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
/// MASTER_PORT; no MPI or Slurm variables), TWOBP_TEST_SCENARIO=scenario and `extra(rank)`'s variables. Returns
/// their exit codes; children still running after `limit` are killed (code -9; their stacks printed first, see
/// print_stacks) and the test fails.
inline std::vector<int> run_processes(const std::string& test, const std::string& scenario, int world,
                                      std::chrono::seconds limit = std::chrono::seconds(60),
                                      const std::function<std::vector<std::string>(int)>& extra = nullptr) {
  const int port = free_port();
  EXPECT_GT(port, 0) << "no free TCP port on 127.0.0.1";
  std::vector<std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    // A test run under mpirun/srun must not hand its own launcher's variables to the children.
    if (entry.rfind("OMPI_", 0) == 0 || entry.rfind("PMI", 0) == 0 || entry.rfind("SLURM_", 0) == 0) continue;
    base.push_back(entry);
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    // The job's variables first: getenv() returns the first entry of a name, so they win over inherited ones.
    std::vector<std::string> env{"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                                 "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                 "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                 "TWOBP_TEST_SCENARIO=" + scenario};
    if (extra) {
      for (const std::string& kv : extra(r)) env.push_back(kv);
    }
    env.insert(env.end(), base.begin(), base.end());
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe", filter = "--gtest_filter=" + test;
    std::vector<char*> argv{exe.data(), filter.data(), nullptr};
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data());
    EXPECT_EQ(rc, 0) << "posix_spawn failed";
    if (rc == 0) pids.push_back(pid);
  }
  std::vector<int> codes(pids.size(), -1);
  std::vector<bool> done(pids.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (std::size_t left = pids.size(); left > 0;) {
    for (std::size_t k = 0; k < pids.size(); ++k) {
      if (done[k]) continue;
      int status = 0;
      if (waitpid(pids[k], &status, WNOHANG) == pids[k]) {
        done[k] = true;
        --left;
        codes[k] = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (std::size_t k = 0; k < pids.size(); ++k) {
        if (!done[k]) print_stacks(pids[k]);
      }
      for (std::size_t k = 0; k < pids.size(); ++k) {
        if (!done[k]) {
          kill(pids[k], SIGKILL);
          waitpid(pids[k], nullptr, 0);
          codes[k] = -9;
        }
      }
      ADD_FAILURE() << "scenario " << scenario << ": ranks still running after " << limit.count() << " s were killed";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return codes;
}

}  // namespace twobp::testing
