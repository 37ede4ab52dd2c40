#pragma once
// The Executor walks one rank's action list for one training step: one small handler per action type, one
// mailbox through which every tensor passes from the action that produces it to the action that consumes it, and
// hooks that run after each action. Pipeline owns one; tests may drive one directly with any Transport.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/schedule.h"
#include "twobp/runtime/hang_report.h"
#include "twobp/stage.h"
#include "twobp/trace/trace.h"
#include "twobp/transport/transport.h"

namespace twobp {

namespace detail {
class MemoryBound;   // src/runtime/memory_bound.h
class Messenger;     // src/runtime/messenger.h
class RankActivity;  // src/runtime/rank_activity.h
}  // namespace detail

/// What one step produced on this rank.
struct StepResult {
  /// Per micro-batch, on the rank owning the last stage (empty elsewhere): each micro-batch's loss as the loss
  /// function returned it, *not* scaled by 1/num_micro_batches (only its gradient seed is scaled).
  std::vector<double> losses;
  Trace trace;  ///< this rank's actions with their times
  /// With data parallelism (PipelineOptions::data_parallel): microseconds step() waited, after this rank's last
  /// action, for the gradient reductions to finish -- their time left exposed on the critical path. 0 otherwise.
  double reduce_wait_us = 0.0;
  /// Pipeline::step's wall time on this rank, in microseconds: the executor's run (Trace::step_us), the wait
  /// above, and the pipeline's own work around them (twobp/trace/attribution.h tells them apart). -1 from a bare
  /// Executor::run.
  double pipeline_us = -1.0;
  /// With ExecutorOptions::record_memory: the most tensor memory this rank held during the step, in bytes
  /// (twobp/metrics/memory.h; the max of the trace events' memory_peak). -1 when not recorded.
  int64_t peak_memory_bytes = -1;
};

/// Passed to hooks after each action.
struct ActionEvent {
  int rank = 0;
  const Action* action = nullptr;
  Stage* stage = nullptr;  ///< the stage a compute action ran on; null for communication actions
};

struct ExecutorOptions {
  /// Every blocking wait gives up after this long with an error naming the peer, the action and the micro-batch.
  Duration timeout = std::chrono::minutes(5);
  /// Fixed shapes of the stage boundaries, optional: output of `stage` for one micro-batch (= input of
  /// stage + 1), asked only for boundaries that cross ranks (so it need not cover the last stage). With a spec,
  /// receivers allocate from it and post their receives ahead, and every sent tensor is checked against it, so a
  /// mismatch is reported on the first step naming both stages. Without one, senders announce shapes in a small
  /// header before each message: shapes may then vary by micro-batch and step (variable sequence lengths), at
  /// the cost of one more small message per boundary crossing (measured by `twobp_bench pipeline --variable-seq`).
  /// activation_spec: boundaries of one tensor; boundary_spec: several named tensors (see NamedTensors), in the
  /// order the stage returns them. At most one of the two.
  std::function<TensorSpec(int stage)> activation_spec;
  std::function<BoundarySpec(int stage)> boundary_spec;
  /// Receives are posted this many RECV actions ahead of their use, so data arrives while the rank computes -- on
  /// a transport whose receives hold the device (Transport::receives_hold_device(): NCCL), never ahead of one of
  /// this rank's SENDs that precede them.
  int prefetch_receives = 4;
  /// The count of runs whose messages must stay apart (see message_tag_span): each run() takes the next value.
  /// Shared by the executors of one pipeline (training and evaluation); null: the executor counts its own.
  std::shared_ptr<std::int64_t> run_counter;
  /// Memory-bounded 2BP: at most this many micro-batches per stage may wait for their W (0: no limit, as the
  /// schedule says). When an I would leave more, the oldest one's W runs right after that I (its time counts in
  /// the I's trace event), and the schedule's W skips it. Gradients are unchanged: W only ever runs after its I.
  int max_pending_weight_micro_batches = 0;
  /// Records the rank's tensor memory around every action (TraceEvent::memory_*, StepResult::peak_memory_bytes).
  /// Needs memory::measurable(transport.device()) (on CPU: memory::count_cpu_allocations() first).
  bool record_memory = false;
  /// Memory-bounded 2BP in bytes (0: no limit; implies record_memory). Before each action, while the rank's tensor
  /// memory plus the most that kind of action added while it ran (kind: type, stage, and whether it is the stage's
  /// first W or B of the step, which allocates gradients; measured in this step or an earlier one, and for a kind
  /// not seen yet the most any action added) would exceed the limit, the rank's oldest deferred W (the
  /// micro-batch whose I ran first) runs, as a W event of its own in the trace, and the schedule's W skips it --
  /// unless that W is expected to rise at least as high itself. Only deferred W work can be moved: what the
  /// schedule needs beyond that (activations, standard mode) is not bounded, and a step's first actions of each
  /// kind have no measurement yet, so a first step may exceed it. Gradients are unchanged.
  int64_t memory_limit_bytes = 0;
  /// The device whose tensor memory is recorded and bounded; unset: the transport's. Set it when the chunks
  /// compute on another device than the one activations travel on (e.g. CUDA chunks over a CPU transport).
  std::optional<c10::Device> memory_device;
  /// Asked before each W and B with the action's index in the rank's list: a function for Stage::backward_weight
  /// to call with parameters whose gradient is final during that action, or null (data-parallel reduction uses
  /// it). A B given one runs as I and W back to back, so that its W can report them (the same gradients).
  std::function<autograd::ParametersDone(std::size_t action_index)> parameters_done;
  /// Evaluation: every F runs Stage::evaluate (no graph, nothing kept). The schedule must then hold forward
  /// actions only (forward_only()); a backward action is a ScheduleError.
  bool evaluate = false;
  /// Runs the schedule's overlapped F&B pairs (Action::overlapped_with_next) at once. Called with the pair's two
  /// actions and two closures, the F's and the B's (or I's) computation, whose inputs the executor has already
  /// taken and whose outputs it stores once the hook returns; the hook must call each exactly once, one after the
  /// other in either order or concurrently on two threads or streams (each closure carries the calling thread's
  /// LibTorch state: grad mode, autocast, ...). The schedule must be in for_overlapped_pairs() layout (the
  /// Pipeline converts it). Inside a pair, a data-parallel stage's buckets start after the pair rather than during
  /// its B. Not combined with record_memory or memory_limit_bytes (the parts' memory cannot be told apart). Null
  /// (the default): the parts run as two ordinary actions, in order.
  std::function<void(const Action& forward, const Action& backward, const std::function<void()>& run_forward,
                     const std::function<void()>& run_backward)>
      overlap_forward_backward;
};

/// Interprets `schedule.actions[rank]` for one step at a time.
///
/// Data flow: an F of stage s puts the activation (s, mb) into the mailbox; a SEND_F takes it from there, a RECV_F
/// of stage s + 1 puts the received one back under the same key on the other rank, and the F of stage s + 1 takes
/// it, wherever it came from. Input gradients flow the same way backwards. A missing item is a schedule-order bug
/// and raises ScheduleError naming the action; a tensor whose shape or dtype differs from the boundary's spec is a
/// UsageError naming both stages, raised before it is sent.
///
/// Messages: an item is a NamedTensors; each tensor travels as one message. With fixed specs the receiver
/// allocates from the spec and posts its receives ahead; without, the sender first sends a shape header
/// (twobp/schedule/schedule.h: MessagePart, channels 2 and 3) from which the receiver allocates, so shapes may
/// change from micro-batch to micro-batch and step to step. A gradient message says which gradients are undefined
/// (nothing downstream depended on that tensor) and carries only the others, so the upstream stage's parameters
/// get exactly the gradients (and undefined ones) loss.backward() gives them.
///
/// Errors: when an action throws, every stage forgets the step, the transport is aborted (so that peers fail
/// fast naming this rank instead of waiting for their timeouts) and the exception is rethrown.
class Executor {
 public:
  using Hook = std::function<void(const ActionEvent&)>;

  /// `stages` are the stages `schedule` places on `rank`, by global index; they and `transport` must outlive the
  /// executor.
  Executor(const Schedule& schedule, int rank, std::map<int, Stage*> stages, Transport& transport,
           ExecutorOptions options);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Runs `hook` after every action (after its trace event is recorded), in the order hooks were added, on the
  /// calling thread. A hook that throws fails the step like an action that throws.
  void add_hook(Hook hook);

  /// One step: `inputs` (each tensor split into micro-batches along dim 0) is needed on the rank owning stage 0,
  /// `targets` on the rank owning the last stage.
  StepResult run(const NamedTensors& inputs, const NamedTensors& targets);
  /// One step over micro-batches given one by one (they may differ in shape: sequence lengths, sizes); one entry
  /// per micro-batch where needed (as above), empty vectors elsewhere.
  StepResult run(const std::vector<NamedTensors>& inputs, const std::vector<NamedTensors>& targets);

  /// The reason this rank aborted its transport with when the last run() failed inside an action (it names the
  /// action where the error cannot carry it: the user's own exception types), so that whoever tells other groups
  /// of the same error -- the Pipeline's data-parallel replicas -- tells the same; empty when the last run did not
  /// fail so. Clears it.
  std::string take_failure_reason() { return std::exchange(failure_reason_, {}); }

  /// Between runs: this rank now waits in a collective of its step outside the executor -- `what` (e.g. "the
  /// data-parallel gradient reduction") with the other ranks `world_ranks` (Transport::world_rank_of) -- as a hang
  /// report will show it; note_outside_step() when it is over (the next run() replaces it too).
  void note_collective_wait(std::string what, std::vector<int> world_ranks);
  void note_outside_step();
  /// The rank computes `action` again after a collective noted (note_collective_wait) inside it, e.g. ZeRO-2's
  /// blocking reduce-scatters run inside a W on transports without asynchronous collectives.
  void note_computing(const Action& action);
  /// The hang report (twobp/runtime/hang_report.h) of the current run, built now over the transport's status
  /// board (every rank of the job for ParallelGroups' groups); empty without a board. For a wait of this rank that
  /// timed out outside run() (the collective above), before the rank aborts, so that the abort carries it.
  std::string hang_report_for() const;

 private:
  struct Step;
  struct Part;
  // The step: its micro-batches, its actions in order, its end, and what a failure does.
  void take_micro_batches(Step& st, const std::vector<NamedTensors>& inputs,
                          const std::vector<NamedTensors>& targets) const;
  void run_actions(Step& st);
  void finish_step(Step& st);
  [[noreturn]] void fail(Step& st, const std::exception& e);
  // Compute actions, split in three so that an overlapped pair can run two computations at once.
  Part prepare(Step& st, const Action& a, bool allow_parameters_done);
  void compute(Part& part) const;
  void finish(Step& st, Part& part);
  void forward_or_backward(Step& st, const Action& a);
  void execute_pair(Step& st, const Action& forward, const Action& backward);
  void backward_weight(Step& st, const Action& a);
  void send(Step& st, const Action& a);
  void receive(Step& st, const Action& a);
  void execute(Step& st, const Action& a, bool scheduled);
  void run_weight_early(Step& st, int stage, int micro_batch);
  void make_room(Step& st, const Action& next);
  NamedTensors take(Step& st, const ItemRef& item, const Action& a);
  Stage& stage(const Action& a);
  void attach_to_board();

  const Schedule& schedule_;
  int rank_;
  std::map<int, Stage*> stages_;
  Transport& transport_;
  ExecutorOptions options_;
  std::vector<Hook> hooks_;
  std::int64_t tag_offset_ = 0;  // this run's: run number * message_tag_span(schedule_)
  // What this rank is doing, shared with the board's reader, which may outlive this executor.
  std::shared_ptr<detail::RankActivity> activity_;
  std::unique_ptr<detail::Messenger> messenger_;    // the SEND and RECV actions' messages
  std::unique_ptr<detail::MemoryBound> memory_;     // memory records and the byte bound
  std::shared_ptr<StatusBoard> board_;  // the transport's; null: no hang report
  std::string failure_reason_;          // see take_failure_reason()
};

}  // namespace twobp
