#pragma once
// Schedule names: the built-ins and the user's, their defaults, and what a program's --schedule options resolve
// to. The one place every CLI, make_schedule() and the benchmarks read names from.

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "twobp/schedule/schedule.h"

namespace twobp {

/// Built-in names: "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "looped-bfs", "interleaved-zb",
/// "dualpipev", "v-half", "v-min", "synth".
///
/// Placement and requirements (p = ranks, m = micro-batches, v = chunks_per_rank; all need p >= 1, m >= 1):
/// - gpipe, 1f1b, zb-h1, zb-h2: one stage per rank (v must be 1), stage s on rank s; any m.
/// - interleaved-1f1b: p * v stages, stage s on rank s % p; any m: the micro-batches run through the chunks in
///   max(1, m / p) groups as equal as m allows (each of at least p micro-batches, or all m < p). Where that count
///   divides m these are PyTorch's groups (and for m % p == 0 Megatron-LM's); PyTorch refuses the other m.
/// - zb-v: always 2 stages per rank (v must be 2; 1, the default, is read as 2), stage s on rank s for s < p and
///   on rank 2p-1-s otherwise; any m (below 2p - 1 the V is not full and the bubble is not removed).
/// - looped-bfs: p * v stages, stage s on rank s % p (v = 2 by default); any m. Each rank runs all forwards of
///   its chunk 0, then of chunk 1, ..., then the backwards chunk by chunk in reverse, micro-batches from the last
///   (PyTorch's ScheduleLoopedBFS; its backward order is the exception to the increasing order below).
/// - interleaved-zb: p * v stages, stage s on rank s % p (v = 2 by default); any m, in groups as
///   interleaved-1f1b. PyTorch's ScheduleInterleavedZeroBubble (the zero-bubble paper's ZB1P over v chunks).
/// - dualpipev, v-half, v-min: zb-v's V placement (v must be 2; 1 is read as 2); any m. dualpipev is DeepSeek's
///   DualPipeV (PyTorch's ScheduleDualPipeV), written for max(m, 2p) micro-batches with the missing ones dropped
///   as zb-v does. v-half / v-min are the controllable-memory paper's V schedules (arXiv 2405.15362): about p + 2
///   and 2 floor((p + 3) / 3) stage activations per rank from F to I, against 1F1B's 2p chunk activations; the
///   authors' repeating blocks with the paper's squeeze of warm-up and cool-down (actions moved into earlier free
///   slots where that raises no rank's memory peak).
/// - synth: synthesized by search (twobp/schedule/synthesize.h, SynthesizedScheduleGenerator) for the textbook costs F
///   = I = W = 1, B = 2 within 1F1B standard's activation memory, after a short search; v = 1 linear, v = 2 (the
///   default) the V or the interleaved placement, whichever is faster (stage_to_rank says which), v >= 3
///   interleaved; any m. Its split form fuses each backward or splits it, whichever the search found faster.
///   Build a SynthesizedScheduleGenerator with measured costs to synthesize for them.
/// On every stage F's, and likewise I/B's, run in increasing micro-batch order (looped-bfs's backwards excepted).
///
/// Backward modes: kStandard uses B. kSplit (2BP) for gpipe/1f1b/interleaved puts I where B was; in the cool-down
/// (after a rank's last F) a W of the oldest pending micro-batch fills each slot where the rank would idle under
/// F = I = W = 1, and the W's still pending after the rank's last I become one batched W per stage (gpipe: all F,
/// all I, one batched W). zb-h1/zb-h2/zb-v use the zero-bubble papers' I/W placement in split mode and the same
/// order with W dropped and I turned into B in standard mode; so do interleaved-zb (PyTorch's order in split mode),
/// v-half and v-min. dualpipev's split form is DualPipeV's own mix: B's in the steady state, each beside the F of
/// another micro-batch as an overlapped pair (Action::overlapped_with_next), I and W only at the V's turn and in
/// the tail; its standard form has every backward fused and keeps the pairs.
std::vector<std::string> builtin_schedule_names();

/// A named schedule and its defaults. The registry of these is the single source of schedule names: every CLI's
/// --schedule, make_schedule() and the benchmarks read it.
struct ScheduleInfo {
  std::string name;
  std::function<std::unique_ptr<ScheduleGenerator>()> make;
  /// v used when the caller does not choose one (gpipe, 1f1b, zb-h1, zb-h2: 1; the looped and V schedules: 2).
  int default_chunks_per_rank = 1;
  std::string summary;  ///< one line for listings and --help
};

/// Adds a schedule to the registry (thread-safe); its name then works wherever a built-in name does. Throws
/// UsageError when the name is taken or the entry is incomplete.
void register_schedule(ScheduleInfo info);

/// Every registered name: the built-ins in the order of builtin_schedule_names(), then registrations in order.
std::vector<std::string> schedule_names();

/// The registry entry of `name`; throws UsageError naming the known schedules otherwise.
ScheduleInfo schedule_info(std::string_view name);

/// Options for `name` with its default chunks per rank.
ScheduleOptions default_schedule_options(std::string_view name, int ranks, int micro_batches, BackwardMode backward);

/// Generator for a registered name; throws UsageError naming the known names otherwise.
std::unique_ptr<ScheduleGenerator> make_schedule_generator(std::string_view name);

/// Shorthand: make_schedule_generator(name)->generate(options), then validate().
Schedule make_schedule(std::string_view name, const ScheduleOptions& options);

/// What a program's --schedule, --schedule-file and --chunks-per-rank options say, resolved in one place.
struct ScheduleChoice {
  std::string name = "1f1b";  ///< a registered schedule (used when `file` is empty)
  std::string file;           ///< a schedule file (text form, or PyTorch's CSV: load_schedule_file); wins over `name`
  int chunks_per_rank = 0;    ///< 0: the schedule's default
};

/// The schedule `choice` describes, validated: generated by the registry for `ranks`, `micro_batches` and
/// `backward`, or loaded from `choice.file`, which must then be for `ranks` ranks and `micro_batches` micro-batches
/// (its own backward mode is kept). Throws UsageError / ScheduleError / IOError saying which.
Schedule resolve_schedule(const ScheduleChoice& choice, int ranks, int micro_batches, BackwardMode backward);

}  // namespace twobp
