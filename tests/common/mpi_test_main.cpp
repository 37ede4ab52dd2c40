// GoogleTest main for tests run under mpiexec: MPI is initialized (through twobp::MpiEnvironment) before any
// test and finalized after all of them. Every rank runs every test; a failure on any rank fails the job.
// This main replaces twobp_test_main's (an object file's main wins over the static library's); it ends the process
// as that one does, without LibTorch's teardown (twobp::exit_without_teardown), once MPI is finalized.

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "common/mpi_test_env.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/mpi.h"

namespace twobp::mpitest {
MpiEnvironment* g_mpi = nullptr;
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int result = 1;
  {
    twobp::MpiEnvironment env(&argc, &argv);
    twobp::mpitest::g_mpi = &env;
    if (env.rank() != 0) {
      // Keep one full report (rank 0); other ranks print only failures through the default printer's
      // replacement below, so a failure on any rank is still visible.
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      class FailurePrinter : public ::testing::EmptyTestEventListener {
       public:
        explicit FailurePrinter(int rank) : rank_(rank) {}
        void OnTestPartResult(const ::testing::TestPartResult& r) override {
          if (r.failed()) {
            std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                         r.line_number(), r.summary());
          }
        }
        void OnTestEnd(const ::testing::TestInfo& info) override {
          if (info.result()->Failed()) {
            std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
          }
        }

       private:
        int rank_;
      };
      listeners.Append(new FailurePrinter(env.rank()));
    }
    result = RUN_ALL_TESTS();
    twobp::mpitest::g_mpi = nullptr;
  }
  twobp::exit_without_teardown(result);
}
