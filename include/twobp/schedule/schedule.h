#pragma once
// A schedule as data: what each rank does in one training step, and the generator interface. The other
// concerns live beside it: the registry of names (registry.h), the wire protocol between ranks (messages.h), the
// text forms (text.h, pytorch_csv.h), validation (validate.h) and simulation (simulate.h). This header still
// declares all of them (included at its end), as it did before they were split off, so that user code written
// against it (make_schedule, load_schedule, validate, simulate, ...) keeps compiling; include the narrow header
// where only it is needed.

#include <string>
#include <string_view>
#include <vector>

#include "twobp/schedule/action.h"

namespace twobp {

/// Whether a schedule's backward is fused (ordinary backprop, action B) or split by 2BP into I and W.
enum class BackwardMode { kStandard, kSplit };

/// The one spelling of a mode in every option, JSON key, label and text file: "standard" or "2bp".
const char* to_string(BackwardMode mode);
/// Reads to_string()'s spellings and the aliases "fused" and "fused-backward" (standard), "split" and "2BP"
/// (2bp; "split" is what schedule files of before said); throws UsageError naming the valid spellings otherwise.
BackwardMode parse_backward_mode(std::string_view text);

/// Everything a generator needs. `chunks_per_rank` is v (stages per rank) for interleaved and V schedules; the
/// pipeline then has ranks * chunks_per_rank stages.
struct ScheduleOptions {
  int ranks = 2;
  int micro_batches = 4;
  int chunks_per_rank = 1;
  BackwardMode backward = BackwardMode::kSplit;
};

/// A complete pipeline program: for every rank, the ordered actions it executes in one training step.
/// Invariants (checked by validate()): every stage is owned by exactly one rank, every F/I/W/B of a stage is in
/// the owner's list, and every SEND has its RECV on the neighbouring rank.
struct Schedule {
  std::string name;
  int num_ranks = 0;
  int num_stages = 0;
  int num_micro_batches = 0;
  BackwardMode backward = BackwardMode::kSplit;
  std::vector<int> stage_to_rank;            ///< size num_stages
  std::vector<std::vector<Action>> actions;  ///< size num_ranks

  /// Stages owned by `rank`, in increasing order.
  std::vector<int> stages_of(int rank) const;
};

/// A source of schedules. Implement it to plug a custom schedule into every CLI and the Pipeline.
class ScheduleGenerator {
 public:
  virtual ~ScheduleGenerator() = default;
  virtual std::string name() const = 0;
  /// Returns a schedule with compute actions and the communication actions between them.
  /// Throws ScheduleError when the options cannot be honoured (e.g. too few micro-batches for the schedule).
  virtual Schedule generate(const ScheduleOptions& options) const = 0;
};

/// Inserts SEND/RECV actions for every F output and every I/B input gradient that crosses ranks, keeping the
/// compute order. Generators call it; user schedules written with compute actions only may call it too.
Schedule add_communication(Schedule schedule);

/// The forward half of `schedule` (evaluation): each rank's F, SEND_F and RECV_F in their order, every backward
/// action and gradient message dropped. It cannot deadlock where `schedule` does not: every kept wait waits for
/// a kept action that came no later in the original run, and each channel's messages keep their order, so it
/// pairs wherever `schedule` pairs. Same name (with " (forward only)"), placement and micro-batches.
Schedule forward_only(Schedule schedule);

/// `schedule` with each W of k > 1 micro-batches run as k W's of one, in its place, in the same micro-batch order:
/// the same work in smaller actions, so that W's costs come in two sizes and their fixed part can be told from the
/// rest (AutoScheduleOptions::probe_weight_sizes, CostRecorder). Valid wherever `schedule` is: a W sends and
/// receives nothing, and each part still comes after its micro-batch's I. Named "<name> (one micro-batch per W)";
/// unchanged (name too) when no W batches micro-batches.
Schedule one_micro_batch_per_weight(Schedule schedule);

/// The layout in which a runtime runs `schedule`'s overlapped F&B pairs (Action::overlapped_with_next) at once:
/// each pair's receives (those between its parts: the B's) move before its F, its sends (the F's) after its B.
/// Unchanged where there are no pairs. validate() checks this layout as well as the given one, and the Pipeline
/// runs it when PipelineOptions::executor.overlap_forward_backward is set.
Schedule for_overlapped_pairs(Schedule schedule);

}  // namespace twobp

// What this header declared before the split (see the top). At the end: each of these includes this header
// first, so whichever is included first finds the data above already declared.
#include "twobp/schedule/messages.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"
