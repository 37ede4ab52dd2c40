#pragma once
// The subcommands of twobp_bench. Each one registers itself on the app with its options and a callback; a
// failing run reports through CLI::RuntimeError(exit_code), which main() turns into the process exit status.

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"
#include "twobp_cli.h"

namespace twobp::bench {

/// An option whose value must lie in [lo, hi] (by default a count >= 1), its default shown in --help: what most
/// options of the subcommands are.
template <typename T>
CLI::Option* count_option(CLI::App* sub, const std::string& name, T& value, const std::string& help, double lo = 1,
                          double hi = cli::kMaxCount) {
  return sub->add_option(name, value, help)->capture_default_str()->check(cli::number_in(lo, hi));
}

/// A check that a value is a name_list() of `known` ("all", or names separated by commas); its message names the
/// unknown one.
inline std::function<std::string(const std::string&)> names_in(std::vector<std::string> known, std::string what) {
  return [known, what](const std::string& value) -> std::string {
    try {
      name_list(value, known, what);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
}

/// `split`: times forward, stage 1 (I), stage 2 (W) and the fused backward (B) of one stage (split.cpp).
void add_split_command(CLI::App& app);

/// `pipeline`: whole training steps of a pipeline, 2BP against standard, measured bubble and simulator
/// prediction from the costs measured in the same run (pipeline.cpp).
void add_pipeline_command(CLI::App& app);

/// `simulate`: predicted step time, bubble and peak memory of every built-in schedule, 2BP against standard, for
/// p ranks and m micro-batches from given or measured stage costs; no model runs (simulate.cpp).
void add_simulate_command(CLI::App& app);

/// `check-schedules`: whether every built-in schedule pairs its messages correctly under a transport's pairing
/// rule (check_schedules.cpp).
void add_check_schedules_command(CLI::App& app);

/// `plan`: ranks schedule, mode, v, m, recomputation and dp x pp for a LLaMa-like model on N ranks by simulated
/// throughput among the candidates that fit in memory; estimated or measured costs (plan.cpp).
void add_plan_command(CLI::App& app);

/// `zero`: per-rank memory (gradient peak, masters, optimizer state) and data-parallel bytes of ZeRO 0, 1 and 2
/// on a small LLaMa, dp replicas as rank threads (zero.cpp).
void add_zero_command(CLI::App& app);

}  // namespace twobp::bench
