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
// A twobp W over several micro-batches is written as one W cell per micro-batch (PyTorch's W takes one), and two
// W's of one stage that follow each other with an empty cell between them (an idle slot, which PyTorch's
// _load_csv reads as None); reading, `merge_weight_runs` turns adjacent W cells of one stage back into one batched
// W (the same gradients, fewer and larger GEMMs) and an empty cell ends such a run. So to_pytorch_csv ->
// from_pytorch_csv (default options) gives back the compute actions of every schedule in their order, W sizes
// included, and every built-in schedule's actions exactly (the communication, which the CSV leaves out, is
// add_communication's).

#include <string>
#include <string_view>

#include "twobp/schedule/schedule.h"

namespace twobp {

struct PytorchCsvOptions {
  /// Adjacent W cells of the same stage on a rank (no empty cell between) become one W over their micro-batches;
  /// false: one W per cell.
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
