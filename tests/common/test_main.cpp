// GoogleTest's main for the test binaries, ending the process without LibTorch's teardown
// (twobp::exit_without_teardown: ~0.2 s of each of the suite's hundreds of test processes). A test with a main of
// its own (mpi_test_main.cpp) keeps it: an object file's main wins over this archive's.

#include <gtest/gtest.h>

#include "twobp/runtime/launch.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  twobp::exit_without_teardown(RUN_ALL_TESTS());
}
