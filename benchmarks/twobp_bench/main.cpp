// twobp_bench: benchmarks of the twobp library, one subcommand each (see commands.h).
//
//   twobp_bench split --json split.json        cost of the 2BP split on one stage (split.cpp)
//   twobp_bench pipeline --json pipeline.json  throughput of pipelines, 2BP vs standard (pipeline.cpp)
//   twobp_bench simulate --ranks 64 ...        predicted step time of every schedule from stage costs (simulate.cpp)
//   twobp_bench check-schedules --transport nccl   does every built-in schedule pair on it (check_schedules.cpp)
//   twobp_bench zero --json zero.json          memory and data-parallel bytes of ZeRO 0, 1, 2 (zero.cpp)

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <optional>

#include "commands.h"
#include "twobp/runtime/launch.h"
#include "twobp_cli.h"

namespace {

int run_main(int argc, char** argv) {
  CLI::App app{"twobp benchmarks"};
  app.require_subcommand(1);
  twobp::cli::add_version_flag(app, "twobp_bench");
  app.footer(R"(Examples:
  twobp_bench split --json split.json                            # what the 2BP split costs on one stage
  mpirun -np 2 twobp_bench pipeline --schedule 1f1b,zb-h1 --json p.json   # 2BP against standard backprop
  twobp_bench simulate --ranks 64 --microbatches 256 --json sim.json      # every schedule at scale
  twobp_bench plan --model 7b --ranks 4 --gpu-memory-gb 80                # which configuration to run
Each command's options: twobp_bench COMMAND --help. Metrics: docs/BENCHMARKS.md in the source tree.)");
  twobp::bench::add_split_command(app);
  twobp::bench::add_pipeline_command(app);
  twobp::bench::add_simulate_command(app);
  twobp::bench::add_check_schedules_command(app);
  twobp::bench::add_plan_command(app);
  twobp::bench::add_zero_command(app);
  // Usage errors exit 2 (a mistyped command is told the closest one); a subcommand that failed with
  // CLI::RuntimeError(code) exits with its code; twobp's own errors 2, others 1 (twobp_cli.h).
  try {
    if (const std::optional<int> status = twobp::cli::parse(app, argc, argv)) return *status;  // runs the command
  } catch (const std::exception& e) {
    std::cerr << "twobp_bench: " << twobp::cli::error_message(e) << "\n";
    return twobp::cli::failure_status(e);
  }
  return 0;
}

}  // namespace

// Static objects are left to the operating system: LibTorch's teardown costs each run ~0.2 s (launch.h).
int main(int argc, char** argv) { twobp::exit_without_teardown(run_main(argc, argv)); }
