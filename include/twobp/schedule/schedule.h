#pragma once
// Schedules as data: generators, text form, grid, validation and simulation.

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "twobp/schedule/action.h"
#include "twobp/transport/pairing.h"

namespace twobp {

/// Whether a schedule's backward is fused (ordinary backprop, action B) or split by 2BP into I and W.
enum class BackwardMode { kStandard, kSplit };

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

/// Built-in names: "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "looped-bfs", "interleaved-zb",
/// "dualpipev", "v-half", "v-min".
///
/// Placement and requirements (p = ranks, m = micro-batches, v = chunks_per_rank; all need p >= 1, m >= 1):
/// - gpipe, 1f1b, zb-h1, zb-h2: one stage per rank (v must be 1), stage s on rank s; any m.
/// - interleaved-1f1b: p * v stages, stage s on rank s % p; the micro-batches run in max(1, m / p) equal groups
///   through the chunks, so that count must divide m (PyTorch's relaxation of Megatron-LM's m % p == 0).
/// - zb-v: always 2 stages per rank (v must be 2; 1, the default, is read as 2), stage s on rank s for s < p and
///   on rank 2p-1-s otherwise; any m (below 2p - 1 the V is not full and the bubble is not removed).
/// - looped-bfs: p * v stages, stage s on rank s % p (v = 2 by default); any m. Each rank runs all forwards of
///   its chunk 0, then of chunk 1, ..., then the backwards chunk by chunk in reverse, micro-batches from the last
///   (PyTorch's ScheduleLoopedBFS; its backward order is the exception to the increasing order below).
/// - interleaved-zb: p * v stages, stage s on rank s % p (v = 2 by default); m in max(1, m / p) equal groups as
///   interleaved-1f1b. PyTorch's ScheduleInterleavedZeroBubble (the zero-bubble paper's ZB1P over v chunks).
/// - dualpipev, v-half, v-min: zb-v's V placement (v must be 2; 1 is read as 2); any m. dualpipev is DeepSeek's
///   DualPipeV (PyTorch's ScheduleDualPipeV), written for max(m, 2p) micro-batches with the missing ones dropped
///   as zb-v does. v-half / v-min are the controllable-memory paper's V schedules (arXiv 2405.15362): about p + 2
///   and 2 floor((p + 3) / 3) stage activations per rank from F to I, against 1F1B's 2p chunk activations.
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

/// Inserts SEND/RECV actions for every F output and every I/B input gradient that crosses ranks, keeping the
/// compute order. Generators call it; user schedules written with compute actions only may call it too.
Schedule add_communication(Schedule schedule);

/// The forward half of `schedule` (evaluation): each rank's F, SEND_F and RECV_F in their order, every backward
/// action and gradient message dropped. It cannot deadlock where `schedule` does not: every kept wait waits for
/// a kept action that came no later in the original run, and each channel's messages keep their order, so it
/// pairs wherever `schedule` pairs. Same name (with " (forward only)"), placement and micro-batches.
Schedule forward_only(Schedule schedule);

/// The layout in which a runtime runs `schedule`'s overlapped F&B pairs (Action::overlapped_with_next) at once:
/// each pair's receives (those between its parts: the B's) move before its F, its sends (the F's) after its B.
/// Unchanged where there are no pairs. validate() checks this layout as well as the given one, and the Pipeline
/// runs it when PipelineOptions::overlap_forward_backward is set.
Schedule for_overlapped_pairs(Schedule schedule);

/// For a communication action of `schedule`: the rank at the other end of the link (the owner of stage + 1 for
/// SEND_F and RECV_B, of stage - 1 for RECV_F and SEND_B). Throws ScheduleError for compute actions or when the
/// neighbouring stage does not exist.
int peer_rank(const Schedule& schedule, const Action& action);

/// The messages of one SEND/RECV: the tensors of a boundary (NamedTensors) travel as one message each, after a
/// shape header when the sender announces shapes (no activation specs). At most kMaxTensorsPerMessage tensors.
constexpr int kMaxTensorsPerMessage = 15;
/// Which message of a SEND/RECV: the shape header, or the k-th tensor (MessagePart{k}).
struct MessagePart {
  static MessagePart header() { return MessagePart{-1}; }
  bool is_header() const { return tensor < 0; }
  int tensor = 0;  ///< index of the tensor among those the SEND carries; -1 for the header
};

/// For a communication action: a tag, identical for a SEND and its matching RECV, that is unique per (stage
/// boundary, micro-batch, direction, part): ((mb * num_stages + boundary) * 2 + dir) * (kMaxTensorsPerMessage + 1)
/// + part.tensor + 1, where boundary is the lower stage of the link, dir is 0 for activations (SEND_F/RECV_F) and 1
/// for gradients (SEND_B/RECV_B).
std::int64_t message_tag(const Schedule& schedule, const Action& action, MessagePart part = {});

/// Every tag message_tag() gives for `schedule` lies in [0, span): num_micro_batches * num_stages * 2 *
/// (kMaxTensorsPerMessage + 1). The executor tags run n's messages message_tag + n * span, so that a message of one
/// run (a step, an evaluation) never pairs with a receive of another -- a duplicated or stale message is then left
/// unmatched (by-tag pairing) or refused naming both tags (in-order pairing, MPI's header check), never taken for
/// the next step's.
std::int64_t message_tag_span(const Schedule& schedule);

/// Channels of a schedule's messages: activations (SEND_F/RECV_F) travel on channel 0, gradients (SEND_B/RECV_B)
/// on channel 1, so a channel -- (source rank, destination rank, channel) -- carries one kind of tensor in one
/// direction; shape headers travel on channels 2 and 3 alike, so that a receiver may post the next headers before
/// it knows (and posts) the tensors of the current message. In-order transports (Pairing::kInOrderPerChannel) pair
/// messages per channel; this split is what makes every built-in schedule, zb-v included, pair correctly on them
/// (validate() checks the tensor channels; headers follow the same order on theirs).
constexpr int kNumMessageChannels = 4;

/// For a communication action: its channel in [0, kNumMessageChannels), identical for a SEND and its matching RECV.
/// The one place the action -> channel mapping is written: validate(), the Executor (P2POptions::channel) and
/// through it every transport read it here. Throws ScheduleError for compute actions.
int message_channel(const Action& action, MessagePart part = {});

/// Text form: a header line, then one action per line. dump() and load() round-trip exactly.
std::string dump_schedule(const Schedule& schedule);
/// Parses the text form; throws ScheduleError naming the line number and what was expected.
Schedule load_schedule(std::string_view text);
/// load_schedule() of a file's contents -- or, for a name ending in ".csv", from_pytorch_csv()
/// (twobp/schedule/pytorch_csv.h); IOError when it cannot be read, ScheduleError naming the file otherwise.
Schedule load_schedule_file(const std::string& path);

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

/// ASCII picture: one row per rank, one column per time slot of a unit-cost simulation. `mark`, if given,
/// is highlighted (used to point at the offending action of an invalid schedule).
std::string render_grid(const Schedule& schedule, const Action* mark = nullptr, int mark_rank = -1);

/// Checks ordering (F before I/B, I before W, stage dependencies across ranks), send/recv matching, that every
/// (stage, micro-batch) is computed exactly once, and that a dry run cannot deadlock. With
/// Pairing::kInOrderPerChannel it also checks that on every channel (see message_channel) the sender posts its
/// sends in the order the receiver posts its receives -- the Pipeline posts both in action-list order -- since
/// such a transport would otherwise deliver tensors to the wrong buffers. Throws ScheduleError with the grid and
/// the offending action marked.
void validate(const Schedule& schedule, Pairing pairing = Pairing::kByTag);

/// Per-action costs for the simulator, in any time unit (the result uses the same unit).
struct CostModel {
  std::vector<double> forward;          ///< per stage
  std::vector<double> backward_input;   ///< per stage (I)
  std::vector<double> backward_weight;  ///< per stage and micro-batch (W of k micro-batches costs k times this)
  std::vector<double> backward;         ///< per stage (fused B); if empty, I + W
  /// Activation recomputation (StageOptions::recompute), per stage: the time to re-run the forward, added to every
  /// I and B of that stage (usually its forward cost; 0 for stages without). Empty (the default): no recomputation.
  std::vector<double> recompute;
  double communication = 0.0;           ///< latency of one send, sender to receiver

  /// Data parallelism (dp replicas of the pipeline): per stage, the time to all-reduce that stage's gradients over
  /// its data-parallel group (e.g. metrics::ring_all_reduce_seconds of its gradient bytes, in this model's unit).
  /// Empty (the default): no data parallelism, and simulate() behaves exactly as without these fields.
  std::vector<double> data_parallel_reduce;
  /// When a stage's all-reduce may start. true: as soon as its gradients are complete, i.e. at the end of the
  /// stage's last weight-producing action of the step (its last W, or last B in standard mode), so that it overlaps
  /// the rank's remaining actions and idle time (what 2BP's deferred W makes possible). false: after the rank's last
  /// action, as a framework that reduces all gradients once backward is over does.
  bool overlap_data_parallel = true;
  /// Each stage's reduction in this many equal buckets (>= 1). With overlap, the buckets of a stage whose last
  /// weight action is a W become ready one by one during that W (bucket j at (j + 1) / k of its duration: the
  /// runtime starts a bucket as soon as the W's layers that fill it have run); after a B all are ready at its end
  /// (the runtime reduces B's gradients once the B is over).
  int data_parallel_buckets = 1;

  /// The same costs for every stage.
  static CostModel uniform(int num_stages, double f, double i, double w, double comm = 0.0);
};

struct SimulatedEvent {
  int rank = 0;
  Action action;
  double start = 0.0;
  double end = 0.0;
};

struct SimulationResult {
  /// The slowest rank's step end: max over ranks of max(end of its last action, end of its last all-reduce).
  double step_time = 0.0;
  /// metrics::bubble_fraction (twobp/metrics/metrics.h) of the compute busy times over step_time (so all-reduce
  /// time that is not hidden counts as idle compute).
  double bubble_fraction = 0.0;
  /// Data parallelism (CostModel::data_parallel_reduce): how far the all-reduces pushed a rank's step end past its
  /// last action, max(0, end of its last all-reduce − end of its last action), per rank (size num_ranks; all 0
  /// without data parallelism), and the max over ranks. step_time − (step_time without data parallelism) can be
  /// smaller than data_parallel_exposed, when the rank whose reductions are exposed is not the slowest.
  std::vector<double> data_parallel_exposed_per_rank;
  double data_parallel_exposed = 0.0;
  std::vector<int> peak_live_micro_batches;  ///< per rank: max micro-batches whose activations are alive
  std::vector<SimulatedEvent> events;        ///< compute actions with their times
};

/// Event-driven simulation of `schedule` under `costs`: each rank runs its actions in order, an F/I/B waits for
/// its input to arrive (communication latency after the producer finished).
/// With data parallelism (costs.data_parallel_reduce not empty) each rank also has one reduction link, separate from
/// compute and from pipeline communication: each bucket of each of its stages (CostModel::data_parallel_buckets)
/// starts at max(when it is ready -- see CostModel::overlap_data_parallel --, when the link is free), in the order
/// they become ready (ties: lower stage first), and lasts data_parallel_reduce[stage] / buckets. The optimizer step needs every
/// reduction, so the rank's step ends when both its actions and its reductions are done.
/// Throws UsageError when a cost vector the schedule needs has the wrong size, or a data_parallel_reduce entry is
/// negative or not finite.
SimulationResult simulate(const Schedule& schedule, const CostModel& costs);

/// Tensor memory of one kind of action on one stage, in bytes, for simulate_peak_memory(): what one action leaves
/// allocated when it ends (`added`; negative when it frees more than it allocates) and the most it adds while it
/// runs (`rise`: its working memory plus what it keeps). For W both are per micro-batch of the action. In these
/// terms a micro-batch's activations on a stage are F's `added`, and the (input, output gradient) pairs a deferred
/// W keeps (2BP's extra memory) are −W's `added`.
struct ActionMemory {
  double added = 0.0;
  double rise = 0.0;
};

/// What simulate_peak_memory() needs, in bytes (measured by `twobp_bench pipeline`, or estimated).
struct MemoryModel {
  /// Per rank: tensor memory held when a step starts (weights, optimizer state, caches).
  std::vector<double> base;
  /// Per stage: one ActionMemory per action type, indexed by static_cast<int>(ActionType).
  std::vector<std::array<ActionMemory, kNumActionTypes>> stages;
  /// Per stage: gradient bytes its first weight action of a step (W or B) allocates -- when gradients are reset to
  /// undefined between steps, as Pipeline::zero_grad() does. Empty: none.
  std::vector<double> gradients;
};

/// Peak tensor memory of each rank over one step of `schedule`: each rank walks its actions in order (a rank's
/// memory changes only by its own actions), from base[r]; an action reaches level + rise and leaves level + added
/// (× micro-batches for W; plus gradients[stage] for the stage's first W or B). Throws UsageError when `model`
/// does not cover the schedule's ranks and stages.
std::vector<double> simulate_peak_memory(const Schedule& schedule, const MemoryModel& model);

}  // namespace twobp
