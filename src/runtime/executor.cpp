// The interpreter of one rank's action list. Its helpers each keep one concern: the messages of SEND and RECV
// actions (runtime/messenger.h), memory records and the byte bound (runtime/memory_bound.h), what the rank is
// doing for the hang report (runtime/rank_activity.h), the device timeline (runtime/device_timeline.h) and the
// batch as micro-batches (runtime/micro_batches.h).

#include "twobp/runtime/executor.h"

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <set>
#include <tuple>
#include <utility>

#include "runtime/device_timeline.h"
#include "runtime/memory_bound.h"
#include "runtime/messenger.h"
#include "runtime/micro_batches.h"
#include "runtime/rank_activity.h"
#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/messages.h"
#include "twobp/transport/status_board.h"
#include "util/check.h"
#include "util/failure.h"
#include "util/time.h"

namespace twobp {
namespace {

// The tensors that travel between actions (dependencies() also names what stays inside a Stage: its saved graph
// and pending weight work) are the activations and input gradients.
bool travels(const ItemRef& it) { return it.item == Item::kActivation || it.item == Item::kInputGrad; }

// LibTorch's errors from the chunk's code or the transport (a shape or dtype mismatch, an out-of-memory) say what
// went wrong but not where in the pipeline. The place goes into the error itself, which keeps its type: a caller
// may catch c10::OutOfMemoryError to retry with smaller micro-batches.
void add_where(c10::Error& e, const std::string& where) { e.add_context(fmt::format("in {}", where)); }

// Runs `body` (an action's work); an error escaping it is marked with `where()` ("rank R: F stage s micro-batch m"),
// computed only then. LibTorch's errors take it as context (add_where); twobp's own say where already; any other
// exception -- the user's chunk code or hook throwing its own type -- cannot take it without changing its type,
// which a caller may catch by, so it goes to `failed_in`, from which run() adds it to the reason the peers get and
// to the status board.
template <class Body, class Where>
void locate(std::string& failed_in, Where&& where, Body&& body) {
  try {
    body();
  } catch (c10::Error& e) {
    add_where(e, where());
    throw;
  } catch (const Error&) {
    throw;
  } catch (...) {
    if (failed_in.empty()) failed_in = where();
    throw;
  }
}

void put(std::map<std::tuple<Item, int, int>, NamedTensors>& mailbox, const ItemRef& it, NamedTensors t) {
  mailbox[{it.item, it.stage, it.micro_batch}] = std::move(t);
}

// The one item of `items` that travels between actions, if any.
const ItemRef* travelling(const std::vector<ItemRef>& items) {
  for (const auto& it : items) {
    if (travels(it)) return &it;
  }
  return nullptr;
}

}  // namespace

// The state of one step. Everything is keyed by (item, stage, micro-batch), so the executor follows any valid
// schedule without knowing which one it is.
struct Executor::Step {
  std::map<std::tuple<Item, int, int>, NamedTensors> mailbox;  // (item, stage, micro-batch)
  std::size_t index = 0;  // of the action being executed
  std::vector<NamedTensors> input_mbs, target_mbs;
  // Deferred W work: (stage, micro-batch) whose I ran and whose W did not, oldest first; and the W's that a memory
  // bound ran early (the schedule's W then skips them).
  std::deque<std::pair<int, int>> pending_weight;
  std::set<std::pair<int, int>> early_weight;
  std::set<int> weights_started;  // stages whose first W or B of the step ran (it allocates reset gradients)
  std::vector<at::Tensor> losses;  // on the device until the step ends
  StepResult result;
  Clock::time_point start;
  detail::DeviceTimeline* timeline = nullptr;
  // The action an error other than LibTorch's or twobp's own escaped from (see locate()); empty otherwise.
  std::string failed_in;

  std::string where(int rank, const Action& a) const { return fmt::format("rank {}: {}", rank, describe(a)); }
};

Executor::Executor(const Schedule& schedule, int rank, std::map<int, Stage*> stages, Transport& transport,
                   ExecutorOptions options)
    : schedule_(schedule), rank_(rank), stages_(std::move(stages)), transport_(transport),
      options_(std::move(options)) {
  if (!options_.run_counter) options_.run_counter = std::make_shared<std::int64_t>(0);
  activity_ = std::make_shared<detail::RankActivity>();
  board_ = transport_.status_board();
  // From now on this rank answers ("has not started a step" until its first run): a report then tells a rank
  // whose caller never calls step() from a dead one.
  attach_to_board();
  const auto& actions = schedule_.actions.at(rank_);
  if (options_.overlap_forward_backward) {
    TWOBP_CHECK(!options_.record_memory && options_.memory_limit_bytes == 0, UsageError,
                "rank {}: overlap_forward_backward runs two actions at once, whose memory cannot be told apart: turn "
                "record_memory and memory_limit_bytes off, or run the pairs in order (no overlap hook)",
                rank_);
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const bool next_is_compute = i + 1 < actions.size() && is_compute(actions[i + 1].type);
      TWOBP_CHECK(!actions[i].overlapped_with_next || next_is_compute, UsageError,
                  "rank {}: {} opens an overlapped pair, but its B does not follow directly: with "
                  "overlap_forward_backward the schedule must be in the for_overlapped_pairs() layout (Pipeline "
                  "converts it)",
                  rank_, describe(actions[i]));
    }
  }
  memory_ = std::make_unique<detail::MemoryBound>(options_, transport_, rank_);
  for (const Action& a : actions) {
    const ActionType t = a.type;
    TWOBP_CHECK(!options_.evaluate || t == ActionType::kForward || t == ActionType::kSendForward ||
                    t == ActionType::kRecvForward,
                ScheduleError, "rank {}: evaluation runs forward actions only, but schedule '{}' has {} (use "
                "forward_only())", rank_, schedule_.name, describe(a));
  }
  messenger_ = std::make_unique<detail::Messenger>(schedule_, rank_, transport_, options_, *activity_);
}

Executor::~Executor() = default;

// The reader maps the peers of its statuses to world ranks (a copy of the table: the board may outlive the
// transport).
void Executor::attach_to_board() {
  if (!board_) return;
  std::vector<int> world_of;
  for (int r = 0; r < transport_.world_size(); ++r) world_of.push_back(transport_.world_rank_of(r));
  board_->attach(rank_, [activity = activity_, world_of = std::move(world_of)] { return activity->text(world_of); });
}

void Executor::note_collective_wait(std::string what, std::vector<int> world_ranks) {
  activity_->note_collective(std::move(what), std::move(world_ranks));
}

void Executor::note_outside_step() { activity_->note(RankStatus::State::kOutsideStep, nullptr); }

void Executor::note_computing(const Action& action) { activity_->note(RankStatus::State::kComputing, &action); }

// Asks every rank of the board (the pipeline's, or the whole job's for the groups of ParallelGroups) what it is
// doing (bounded: a rank that cannot answer is reported as such) and builds the report; empty without a board.
// Called on the rank whose own wait timed out, before it aborts, so the abort carries the report to everyone.
std::string Executor::hang_report_for() const {
  if (!board_) return {};
  try {
    const std::int64_t run = tag_offset_ / message_tag_span(schedule_);
    const auto texts = board_->collect(rank_, run, std::min(options_.timeout, Duration(3000)));
    std::vector<std::optional<RankStatus>> statuses;
    // An empty answer: the rank is alive but no executor runs on it yet (StatusBoard's contract).
    for (const auto& t : texts) {
      if (!t) {
        statuses.emplace_back(std::nullopt);
      } else {
        statuses.push_back(t->empty() ? std::optional<RankStatus>(RankStatus{}) : decode_rank_status(*t));
      }
    }
    // The ranks that report one stall may be in different runs (a rank waiting in a collective after run N, its
    // peers already in run N + 1): they agree under the earliest run any rank is in, the same on each of them.
    std::int64_t incident = run;
    for (const auto& s : statuses) {
      if (s && s->run >= 0) incident = std::min(incident, s->run);
    }
    return board_->agree_on_report(incident, hang_report(statuses, transport_.world_rank_of(rank_)));
  } catch (const std::exception& e) {
    return fmt::format("hang report: could not be built: {}", e.what());
  }
}

void Executor::add_hook(Hook hook) { hooks_.push_back(std::move(hook)); }

Stage& Executor::stage(const Action& a) {
  auto it = stages_.find(a.stage);
  TWOBP_CHECK(it != stages_.end(), ScheduleError, "rank {}: {}: stage {} is not on this rank", rank_, describe(a),
              a.stage);
  return *it->second;
}

// Takes an item out of the mailbox (it is used exactly once), or names the action that found it missing.
NamedTensors Executor::take(Step& st, const ItemRef& it, const Action& a) {
  auto found = st.mailbox.find({it.item, it.stage, it.micro_batch});
  TWOBP_CHECK(found != st.mailbox.end(), ScheduleError,
              "{}: {} is not available (an action that produces it must come first: schedule order bug)",
              st.where(rank_, a), describe(it));
  NamedTensors t = std::move(found->second);
  st.mailbox.erase(found);
  return t;
}
// An F, I or B split in three, so that an overlapped pair can run two computations at once: prepare() takes the
// inputs out of the mailbox and finish() stores the outputs (the executor's thread, which owns the step's state);
// compute() runs the stage and touches nothing but the stage and the Part (any thread).
struct Executor::Part {
  const Action* action = nullptr;
  Stage* stage = nullptr;
  NamedTensors input;                // F: the stage input; I/B: the output gradients
  NamedTensors target;               // F of the last stage
  autograd::ParametersDone done;     // B: run as I and W, reporting parameters final (data parallelism)
  NamedTensors output;               // F: activation or loss; I/B: input gradients
};

// The items each part takes and puts come from dependencies(), the one table of action meaning.
Executor::Part Executor::prepare(Step& st, const Action& a, bool allow_parameters_done) {
  Part p;
  p.action = &a;
  p.stage = &stage(a);
  const int mb = a.micro_batches[0];
  const ActionDependencies deps = dependencies(a, schedule_.num_stages);
  const ItemRef* in = travelling(deps.needs);
  if (a.type == ActionType::kForward) {
    p.input = in == nullptr ? st.input_mbs.at(mb) : take(st, *in, a);
    if (a.stage == schedule_.num_stages - 1) p.target = st.target_mbs.at(mb);
    return p;
  }
  // The last stage starts from its loss (an empty set: Stage seeds it); the others from the received gradients.
  if (in != nullptr) p.input = take(st, *in, a);
  // The stage's last B of the step under overlapped data parallelism: run as I and W back to back (the same
  // gradients, tested by the parity suite), so that W reports each layer's parameters final as it produces them
  // and their buckets start during this B -- as DDP's hooks start them during backward -- instead of after it.
  // Standard mode is then compared with its best data-parallel overlap, not with a handicapped one. Not inside an
  // overlapped pair (allow_parameters_done false): the callback starts collectives, which must come from the
  // executor's thread; the buckets then start right after the pair.
  if (a.type == ActionType::kBackward && allow_parameters_done && options_.parameters_done) {
    p.done = options_.parameters_done(st.index);
  }
  return p;
}

void Executor::compute(Part& p) const {
  const Action& a = *p.action;
  const int mb = a.micro_batches[0];
  Stage& s = *p.stage;
  switch (a.type) {
    case ActionType::kForward:
      p.output = options_.evaluate ? s.evaluate(mb, p.input, p.target) : s.forward(mb, p.input, p.target);
      return;
    case ActionType::kBackward:
      if (p.done) {
        p.output = s.backward_input(mb, p.input);
        s.backward_weight({mb}, p.done);
      } else {
        p.output = s.backward(mb, p.input);
      }
      return;
    case ActionType::kBackwardInput:
      p.output = s.backward_input(mb, p.input);
      return;
    default:
      detail::raise<ScheduleError>("rank {}: {} is not an F, I or B", rank_, describe(a));
  }
}

void Executor::finish(Step& st, Part& p) {
  const Action& a = *p.action;
  const int mb = a.micro_batches[0];
  const ActionDependencies deps = dependencies(a, schedule_.num_stages);
  const ItemRef* made = travelling(deps.produces);
  if (made != nullptr) {
    put(st.mailbox, *made, std::move(p.output));
  } else if (a.type == ActionType::kForward) {
    st.losses[mb] = p.output.entry(0).tensor.reshape({1});  // the last stage's output is its loss
  }
  if (a.type != ActionType::kBackwardInput) return;
  st.pending_weight.emplace_back(a.stage, mb);
  // Bounded by count: this stage's oldest deferred W's run inside this I (their time counts in its event).
  const int limit = options_.max_pending_weight_micro_batches;
  if (limit <= 0) return;
  const auto of_stage = [&](const std::pair<int, int>& q) { return q.first == a.stage; };
  while (std::count_if(st.pending_weight.begin(), st.pending_weight.end(), of_stage) > limit) {
    const auto oldest = std::find_if(st.pending_weight.begin(), st.pending_weight.end(), of_stage);
    const int oldest_mb = oldest->second;
    st.pending_weight.erase(oldest);
    run_weight_early(st, a.stage, oldest_mb);
  }
}

void Executor::forward_or_backward(Step& st, const Action& a) {
  Part p = prepare(st, a, /*allow_parameters_done=*/true);
  compute(p);
  finish(st, p);
}

void Executor::backward_weight(Step& st, const Action& a) {
  std::vector<int> mbs;  // the action's micro-batches whose W did not run early
  for (int mb : a.micro_batches) {
    if (st.early_weight.erase({a.stage, mb}) != 0) continue;
    mbs.push_back(mb);
    const auto it = std::find(st.pending_weight.begin(), st.pending_weight.end(), std::make_pair(a.stage, mb));
    if (it != st.pending_weight.end()) st.pending_weight.erase(it);
  }
  stage(a).backward_weight(mbs,
                           options_.parameters_done ? options_.parameters_done(st.index) : autograd::ParametersDone());
}

// A deferred W run before the schedule's W of it (which then skips it): gradients are unchanged, since W only
// ever runs after its I and accumulates into .grad in any order.
void Executor::run_weight_early(Step& st, int stage_index, int micro_batch) {
  const auto where = [&] {
    Action w;
    w.type = ActionType::kBackwardWeight;
    w.stage = stage_index;
    w.micro_batches = {micro_batch};
    return fmt::format("{}, run early to bound the deferred W's", st.where(rank_, w));
  };
  locate(st.failed_in, where, [&] { stages_.at(stage_index)->backward_weight({micro_batch}); });
  st.early_weight.insert({stage_index, micro_batch});
  st.weights_started.insert(stage_index);
}

// Bounded in bytes (ExecutorOptions::memory_limit_bytes): while the memory bound expects `next` or, after it, the
// oldest deferred W not to fit, that W runs now, as an event of its own (MemoryBound::run_oldest_first).
void Executor::make_room(Step& st, const Action& next) {
  if (!memory_->limited()) return;
  const detail::MemoryBound::Need need = memory_->need_of(next, st.weights_started);
  while (!st.pending_weight.empty() &&
         memory_->run_oldest_first(need, st.pending_weight.front().first, st.weights_started)) {
    const auto [oldest_stage, oldest_mb] = st.pending_weight.front();
    st.pending_weight.pop_front();
    Action w;
    w.type = ActionType::kBackwardWeight;
    w.stage = oldest_stage;
    w.micro_batches = {oldest_mb};
    execute(st, w, /*scheduled=*/false);
  }
}

// Runs one action -- of the rank's list (`scheduled`), or a W run early by make_room -- and records its trace
// event (and memory); hooks run after scheduled actions only.
void Executor::execute(Step& st, const Action& a, bool scheduled) {
  using Handler = void (Executor::*)(Step&, const Action&);
  static constexpr Handler kHandlers[] = {
      &Executor::forward_or_backward,  // kForward
      &Executor::forward_or_backward,  // kBackwardInput
      &Executor::backward_weight,      // kBackwardWeight
      &Executor::forward_or_backward,  // kBackward
      &Executor::send,                 // kSendForward
      &Executor::receive,              // kRecvForward
      &Executor::send,                 // kSendBackward
      &Executor::receive,              // kRecvBackward
  };
  const detail::MemoryBound::Mark mark = memory_->begin(a.type, a.stage, st.weights_started);
  activity_->note(RankStatus::State::kComputing, &a);
  if (scheduled) messenger_->prefetch(st.index, is_receive(a.type) ? st.index : 0);
  const Clock::time_point t0 = Clock::now();
  st.timeline->begin_action();
  if (scheduled) {
    locate(st.failed_in, [&] { return st.where(rank_, a); },
           [&] { (this->*kHandlers[static_cast<int>(a.type)])(st, a); });
  } else {
    run_weight_early(st, a.stage, a.micro_batches.at(0));
  }
  if (makes_weight_grads(a.type)) st.weights_started.insert(a.stage);
  st.timeline->end_action();
  TraceEvent event{rank_, a, std::chrono::duration<double, std::micro>(t0 - st.start).count(),
                   detail::elapsed_us(st.start), is_compute(a.type) ? stage(a).take_recompute_us() : 0.0};
  memory_->end(mark, event);
  if (memory_->records()) st.result.peak_memory_bytes = std::max(st.result.peak_memory_bytes, event.memory_peak);
  st.result.trace.events.push_back(std::move(event));
  if (scheduled && !hooks_.empty()) {
    const ActionEvent e{rank_, &a, is_compute(a.type) ? &stage(a) : nullptr};
    for (const auto& hook : hooks_) hook(e);
  }
}

// An overlapped pair handed to ExecutorOptions::overlap_forward_backward: both parts' inputs are taken first (the
// for_overlapped_pairs layout put their receives before the F), the two computations go to the hook, both outputs
// are stored once it returns; each part gets a trace event spanning the pair, then the hooks run for each.
void Executor::execute_pair(Step& st, const Action& f, const Action& b) {
  activity_->note(RankStatus::State::kComputing, &f);
  messenger_->prefetch(st.index, 0);
  Part pf = prepare(st, f, /*allow_parameters_done=*/false);
  Part pb = prepare(st, b, /*allow_parameters_done=*/false);
  const Clock::time_point t0 = Clock::now();
  st.timeline->begin_action();
  const at::ThreadLocalState state;  // grad mode, autocast, ... of this thread, for a hook that uses others
  std::atomic<int> ran_f{0}, ran_b{0};
  const std::function<void()> run_f = [&] {
    ++ran_f;
    at::ThreadLocalStateGuard guard(state);
    compute(pf);
  };
  const std::function<void()> run_b = [&] {
    ++ran_b;
    at::ThreadLocalStateGuard guard(state);
    compute(pb);
  };
  locate(st.failed_in, [&] { return fmt::format("{} overlapped with {}", st.where(rank_, f), describe(b)); },
         [&] { options_.overlap_forward_backward(f, b, run_f, run_b); });
  TWOBP_CHECK(ran_f.load() == 1 && ran_b.load() == 1, UsageError,
              "{}: the overlap hook must run each part of the pair exactly once; it ran the F {} and the {} {} "
              "times",
              st.where(rank_, f), ran_f.load(), to_string(b.type), ran_b.load());
  st.timeline->end_action(2);
  finish(st, pf);
  finish(st, pb);
  if (b.type == ActionType::kBackward) st.weights_started.insert(b.stage);
  const double start_us = std::chrono::duration<double, std::micro>(t0 - st.start).count();
  const double end_us = detail::elapsed_us(st.start);
  for (Part* part : {&pf, &pb}) {
    st.result.trace.events.push_back(
        TraceEvent{rank_, *part->action, start_us, end_us, part->stage->take_recompute_us()});
  }
  for (Part* part : {&pf, &pb}) {
    const ActionEvent e{rank_, part->action, part->stage};
    for (const auto& hook : hooks_) hook(e);
  }
}

void Executor::send(Step& st, const Action& a) {
  messenger_->send(a, take(st, dependencies(a, schedule_.num_stages).needs.at(0), a));
}

void Executor::receive(Step& st, const Action& a) {
  NamedTensors received = messenger_->receive(st.index);
  // Filed under the producing stage, exactly where a local producer would have put it.
  put(st.mailbox, dependencies(a, schedule_.num_stages).produces.at(0), std::move(received));
}

StepResult Executor::run(const NamedTensors& inputs, const NamedTensors& targets) {
  const int m = schedule_.num_micro_batches, last = schedule_.num_stages - 1;
  std::vector<NamedTensors> input_mbs, target_mbs;
  try {
    if (stages_.count(0) && stages_.count(last)) {
      detail::check_inputs_match_targets(inputs, targets, fmt::format("rank {}: the batch", rank_));
    }
    if (stages_.count(0)) input_mbs = detail::split_into_micro_batches(inputs, m, rank_, 0, "inputs");
    if (stages_.count(last)) target_mbs = detail::split_into_micro_batches(targets, m, rank_, last, "targets");
  } catch (const std::exception& e) {
    try {
      transport_.abort(detail::failure_reason(rank_, e));
    } catch (...) {
    }
    // A peer's abort arrives as TransportError: re-raise it with the root cause's type (util/failure.h).
    if (std::exception_ptr root = detail::as_root_type(e)) std::rethrow_exception(root);
    throw;
  }
  return run(input_mbs, target_mbs);
}

StepResult Executor::run(const std::vector<NamedTensors>& inputs, const std::vector<NamedTensors>& targets) {
  failure_reason_.clear();
  // Every rank runs the same runs in the same order, so they agree on the run number without a message.
  const std::int64_t run_number = (*options_.run_counter)++;
  tag_offset_ = run_number * message_tag_span(schedule_);
  activity_->set_run(run_number);
  // The running executor answers for this rank (a pipeline's training and evaluation executors take turns).
  attach_to_board();
  messenger_->start_step(tag_offset_);
  Step st;
  st.start = Clock::now();
  detail::DeviceTimeline timeline(transport_.device());
  st.timeline = &timeline;
  try {
    take_micro_batches(st, inputs, targets);
    run_actions(st);
    finish_step(st);
  } catch (const std::exception& e) {
    fail(st, e);
  }
  activity_->note(RankStatus::State::kOutsideStep, nullptr);
  st.result.trace.step_us = detail::elapsed_us(st.start);
  timeline.apply(st.result.trace);
  return std::move(st.result);
}

void Executor::take_micro_batches(Step& st, const std::vector<NamedTensors>& inputs,
                                  const std::vector<NamedTensors>& targets) const {
  const int m = schedule_.num_micro_batches, last = schedule_.num_stages - 1;
  if (stages_.count(0)) st.input_mbs = detail::checked_micro_batches(inputs, m, rank_, 0, "inputs");
  if (stages_.count(last)) {
    st.target_mbs = detail::checked_micro_batches(targets, m, rank_, last, "targets");
    st.losses.resize(m);
  }
  if (stages_.count(0) && stages_.count(last)) {
    for (int k = 0; k < m; ++k) {
      detail::check_inputs_match_targets(st.input_mbs[k], st.target_mbs[k],
                                         fmt::format("rank {} micro-batch {}", rank_, k));
    }
  }
}

void Executor::run_actions(Step& st) {
  const auto& actions = schedule_.actions[rank_];
  for (st.index = 0; st.index < actions.size(); ++st.index) {
    const Action& a = actions[st.index];
    if (a.overlapped_with_next && options_.overlap_forward_backward) {
      execute_pair(st, a, actions[st.index + 1]);  // the constructor checked that the B is next
      ++st.index;
    } else {
      make_room(st, a);
      execute(st, a, /*scheduled=*/true);
    }
    messenger_->retire_completed_sends();
  }
}

// After the last action: the sends delivered, the losses on the host, every micro-batch's backward finished.
void Executor::finish_step(Step& st) {
  messenger_->finish_step();
  if (!st.losses.empty()) {
    // SYNC POINT: the step's only device-to-host copy on the last stage (not one per micro-batch).
    const at::Tensor host = at::cat(st.losses).to(at::kDouble).cpu();
    st.result.losses.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
  }
  for (const auto& [index, stage_ptr] : stages_) {
    TWOBP_CHECK(stage_ptr->live_micro_batches() == 0, ScheduleError,
                "rank {}: stage {} ended the step with {} micro-batches whose backward did not finish", rank_, index,
                stage_ptr->live_micro_batches());
  }
}

// Called from run()'s handler of `e`: every stage forgets the step, the transport is aborted (so that peers fail
// fast naming this rank) and the error rethrown -- with the hang report when this rank's own wait timed out.
void Executor::fail(Step& st, const std::exception& e) {
  // This rank's own wait timed out (not a peer's failure): ask every rank what it is doing while they still
  // wait, and let the abort carry the report to them.
  std::optional<TimeoutError> reported;
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr && dynamic_cast<const RaisedOnAnotherRank*>(&e) == nullptr) {
    const std::string report = hang_report_for();
    if (!report.empty()) reported.emplace(fmt::format("{}\n{}", e.what(), report));
  }
  const std::string failed_in = std::move(st.failed_in);
  // A rank whose own wait timed out stays "waiting" on the board: that is the edge a later report needs.
  if (dynamic_cast<const TimeoutError*>(&e) == nullptr) {
    const std::string what = e.what();
    activity_->note(RankStatus::State::kFailed, nullptr, -1,
                    detail::placed(what.substr(0, what.find('\n')), failed_in));
  }
  for (auto& [index, stage_ptr] : stages_) stage_ptr->reset();
  st = Step{};
  messenger_->clear();
  // Tell every peer now: they would otherwise wait for their timeout on messages this rank will never send.
  failure_reason_ =
      detail::failure_reason(rank_, reported ? static_cast<const std::exception&>(*reported) : e, failed_in);
  try {
    transport_.abort(failure_reason_);
  } catch (...) {
  }
  if (reported) throw *reported;
  // A peer's abort arrives as TransportError: re-raise it with the root cause's type (util/failure.h).
  if (std::exception_ptr root = detail::as_root_type(e)) std::rethrow_exception(root);
  throw;
}

}  // namespace twobp
