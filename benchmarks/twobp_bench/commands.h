#pragma once
// The subcommands of twobp_bench. Each one registers itself on the app with its options and a callback; a
// failing run reports through CLI::RuntimeError(exit_code), which main() turns into the process exit status.

namespace CLI {
class App;
}

namespace twobp::bench {

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

}  // namespace twobp::bench
