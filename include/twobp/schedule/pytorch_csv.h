#pragma once
// Schedules as PyTorch writes them: the "compute_only" CSV of torch.distributed.pipelining
// (PipelineScheduleMulti._dump_csv / _load_csv, torchtitan's pipeline_parallel_schedule_csv).
//
// Format: one row per rank, one cell per action in the rank's order, "<stage><type><micro-batch>" with type F
// (forward), I (input gradient), W (weight gradient) or B (fused backward), e.g. "2F0,2I0,2W0"; an empty cell is an
// idle time slot (skipped); "(<action>;<action>)OVERLAP_F_B" is one F and one B that a runtime may overlap
// (DualPipeV): imported as an overlapped pair (Action::overlapped_with_next) when it is an F and the B or I of
// another stage, otherwise as its parts in order; written back the same way. twobp adds the communication
// (add_communication) and infers the placement (the rank whose row holds a stage), the stage count and the
// micro-batch count.
//
// A twobp W over several micro-batches is written as one W cell per micro-batch (PyTorch's W takes one); reading,
// `merge_weight_runs` turns consecutive W cells of one stage back into one batched W (the same gradients, fewer
// and larger GEMMs), so to_pytorch_csv -> from_pytorch_csv reproduces every built-in schedule's actions.

#include <string>
#include <string_view>

#include "twobp/schedule/schedule.h"

namespace twobp {

struct PytorchCsvOptions {
  /// Consecutive W cells of the same stage on a rank become one W over their micro-batches.
  bool merge_weight_runs = true;
  /// The schedule's name.
  std::string name = "pytorch-csv";
};

/// The compute_only CSV of `schedule` (communication actions left out: PyTorch's lowering adds its own).
std::string to_pytorch_csv(const Schedule& schedule);

/// A schedule from a compute_only CSV, with communication added. Throws ScheduleError naming the row (rank),
/// the cell and what was expected: a cell that is not a compute action (SEND_F, UNSHARD, ... : give the
/// compute_only form), a stage in the rows of two ranks, a stage or micro-batch index that never appears. Call
/// validate() on the result (resolve_schedule does) for ordering, completeness and deadlocks.
Schedule from_pytorch_csv(std::string_view csv, const PytorchCsvOptions& options = {});

}  // namespace twobp
