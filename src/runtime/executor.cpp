#include "twobp/runtime/executor.h"

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "runtime/boundary.h"
#include "twobp/metrics/memory.h"
#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/messages.h"
#include "twobp/transport/status_board.h"
#include "util/check.h"
#include "util/failure.h"
#include "util/format.h"
#include "util/time.h"

namespace twobp {
namespace {

// The tensors that travel between actions (dependencies() also names what stays inside a Stage: its saved graph
// and pending weight work) are the activations and input gradients.
bool travels(const ItemRef& it) { return it.item == Item::kActivation || it.item == Item::kInputGrad; }

// The same tag and channel on both sides of a message; the label names the action on *this* side.
P2POptions message_options(const Schedule& schedule, const Action& a, MessagePart part, Duration timeout,
                           std::int64_t tag_offset) {
  P2POptions o;
  o.peer = peer_rank(schedule, a);
  o.tag = message_tag(schedule, a, part) + tag_offset;
  o.label = part.is_header() ? describe(a) + " (shape header)"
                             : part.tensor == 0 ? describe(a) : fmt::format("{} (tensor {})", describe(a), part.tensor);
  o.channel = message_channel(a, part);
  o.timeout = timeout;
  return o;
}

// "name [2, 3] Double" or "name [2, 3] Bool (no gradient)", joined by ", ": how boundary errors list tensors.
std::string describe_entry(const std::string& name, const std::string& shape, bool gradient) {
  return fmt::format("{} {}{}", name.empty() ? std::string("tensor") : name, shape, gradient ? "" : " (no gradient)");
}

std::string describe_spec(const BoundarySpec& spec) {
  std::vector<std::string> parts;
  for (const auto& t : spec) {
    parts.push_back(describe_entry(t.name, detail::describe_shape(t.shape, t.dtype), t.carries_gradient()));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string describe_announced(const NamedTensors& t, const std::vector<bool>& gradient) {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < t.size(); ++i) {
    const auto& [name, tensor] = t.entry(i);
    parts.push_back(describe_entry(
        name, tensor.defined() ? detail::describe_shape(tensor.sizes(), tensor.scalar_type()) : "undefined",
        gradient[i]));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

// Device timing: on a GPU the host only enqueues work, so host times would describe the enqueueing, not the
// pipeline. Events on this rank's current stream bracket every action; they are read once, after the step.
class DeviceTimeline {
 public:
  explicit DeviceTimeline(c10::Device device) : device_(device), enabled_(!device.is_cpu()) {
    if (enabled_) step_ = record();
  }
  void begin_action() {
    if (enabled_) begin_ = record();
  }
  // `count` actions ran between begin_action() and now (an overlapped pair: both get its span).
  void end_action(int count = 1) {
    if (!enabled_) return;
    std::shared_ptr<c10::Event> begin = std::move(begin_), end = record();
    for (int k = 0; k < count; ++k) actions_.emplace_back(begin, end);
  }
  // SYNC POINT: once per step, after everything was enqueued, to turn the events into the device timeline.
  void apply(Trace& trace) {
    if (!enabled_ || actions_.empty()) return;
    actions_.back().second->synchronize();
    for (std::size_t k = 0; k < actions_.size() && k < trace.events.size(); ++k) {
      trace.events[k].start_us = 1000.0 * step_->elapsedTime(*actions_[k].first);
      trace.events[k].end_us = 1000.0 * step_->elapsedTime(*actions_[k].second);
    }
    trace.step_us = std::max(trace.step_us, trace.events.back().end_us);
  }

 private:
  std::shared_ptr<c10::Event> record() {
    auto e = std::make_shared<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    e->record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
    return e;
  }
  c10::Device device_;
  bool enabled_;
  std::shared_ptr<c10::Event> step_, begin_;
  std::vector<std::pair<std::shared_ptr<c10::Event>, std::shared_ptr<c10::Event>>> actions_;
};

}  // namespace

// The state of one step. Everything is keyed by (item, stage, micro-batch), so the executor follows any valid
// schedule without knowing which one it is.
struct Executor::Step {
  struct PostedRecv {
    at::Tensor header;  // announced shapes: the header, received first
    std::unique_ptr<Work> header_work;
    bool tensors_posted = false;
    std::vector<detail::AnnouncedTensor> layout;  // from the header or the spec
    std::vector<at::Tensor> buffers;              // one per layout entry (undefined when absent)
    std::vector<std::unique_ptr<Work>> works;
  };
  struct PendingSend {
    std::vector<at::Tensor> tensors;  // kept alive until the transport is done with them
    std::vector<std::unique_ptr<Work>> works;
    bool completed() const {
      return std::all_of(works.begin(), works.end(), [](const auto& w) { return w->is_completed(); });
    }
  };

  std::map<std::tuple<Item, int, int>, NamedTensors> mailbox;  // (item, stage, micro-batch)
  std::map<std::size_t, PostedRecv> posted;  // by action index
  std::deque<PendingSend> sends;
  std::size_t next_recv = 0;  // into recv_actions_
  std::size_t index = 0;      // of the action being executed
  std::vector<NamedTensors> input_mbs, target_mbs;
  // Deferred W work: (stage, micro-batch) whose I ran and whose W did not, oldest first; and the W's that a memory
  // bound ran early (the schedule's W then skips them).
  std::deque<std::pair<int, int>> pending_weight;
  std::set<std::pair<int, int>> early_weight;
  std::set<int> weights_started;  // stages whose first W or B of the step ran (it allocates reset gradients)
  std::vector<at::Tensor> losses;  // on the device until the step ends
  StepResult result;
  Clock::time_point start;
  DeviceTimeline* timeline = nullptr;
  bool record_memory = false;
  // The action an error other than LibTorch's or twobp's own escaped from (see locate()); empty otherwise.
  std::string failed_in;

  std::string where(int rank, const Action& a) const { return fmt::format("rank {}: {}", rank, describe(a)); }
};

// Shared with the status board's reader, which may outlive the executor (the board keeps the reader of the last
// executor that ran on this rank), so the action is kept by value.
struct Executor::Activity {
  mutable std::mutex mutex;
  RankStatus::State state = RankStatus::State::kOutsideStep;
  std::optional<Action> action;
  int peer = -1;
  std::int64_t run = -1;
  Clock::time_point since = Clock::now();
  std::string detail;

  std::string text() const {
    std::lock_guard<std::mutex> lock(mutex);
    RankStatus s;
    s.state = state;
    s.action = action ? describe(*action) : std::string();
    s.peer = peer;
    s.run = run;
    s.seconds = std::chrono::duration<double>(Clock::now() - since).count();
    s.detail = detail;
    return encode(s);
  }
};

Executor::Executor(const Schedule& schedule, int rank, std::map<int, Stage*> stages, Transport& transport,
                   ExecutorOptions options)
    : schedule_(schedule), rank_(rank), stages_(std::move(stages)), transport_(transport),
      options_(std::move(options)) {
  if (!options_.run_counter) options_.run_counter = std::make_shared<std::int64_t>(0);
  activity_ = std::make_shared<Activity>();
  board_ = transport_.status_board();
  // From now on this rank answers ("has not started a step" until its first run): a report then tells a rank
  // whose caller never calls step() from a dead one.
  if (board_) board_->attach(rank_, [activity = activity_] { return activity->text(); });
  TWOBP_CHECK(options_.memory_limit_bytes >= 0, UsageError,
              "rank {}: the memory limit must be >= 0 bytes (0: no limit), got {}", rank_, options_.memory_limit_bytes);
  const auto& rank_actions = schedule_.actions.at(rank_);
  if (options_.overlap_forward_backward) {
    TWOBP_CHECK(!options_.record_memory && options_.memory_limit_bytes == 0, UsageError,
                "rank {}: overlap_forward_backward runs two actions at once, whose memory cannot be told apart: turn "
                "record_memory and memory_limit_bytes off, or run the pairs in order (no overlap hook)",
                rank_);
    for (std::size_t i = 0; i < rank_actions.size(); ++i) {
      const bool next_is_compute = i + 1 < rank_actions.size() && is_compute(rank_actions[i + 1].type);
      TWOBP_CHECK(!rank_actions[i].overlapped_with_next || next_is_compute, UsageError,
                  "rank {}: {} opens an overlapped pair, but its B does not follow directly: with "
                  "overlap_forward_backward the schedule must be in the for_overlapped_pairs() layout (Pipeline "
                  "converts it)",
                  rank_, describe(rank_actions[i]));
    }
  }
  if (options_.record_memory || options_.memory_limit_bytes > 0) {
    const c10::Device device = memory_device();
    // A device's allocator statistics are per process: rank threads on one device would read (and reset the
    // peak of) each other's bytes. The CPU counter keeps an account per rank thread instead.
    const bool shared = transport_.ranks_share_process() && !device.is_cpu() &&
                        (device != transport_.device() || transport_.ranks_sharing_device() > 1);
    TWOBP_CHECK(!shared, UsageError,
                "rank {}: recording memory or bounding it in bytes on {}: {} rank threads of this process compute "
                "on that device, and its allocator statistics are the whole process's; run one rank per process "
                "(mpirun, torchrun), give each rank thread a device of its own (LocalOptions::devices), or turn "
                "record_memory and memory_limit_bytes off",
                rank_, device.str(),
                device != transport_.device() ? std::string("several")
                                              : std::to_string(transport_.ranks_sharing_device()));
    TWOBP_CHECK(memory::measurable(device), UsageError,
                "rank {}: recording memory or bounding it in bytes needs the tensor memory of {}: {}", rank_,
                device.str(),
                device.is_cpu()
                    ? "call twobp::memory::count_cpu_allocations() at the start of main(), before building the model"
                    : "its allocator keeps no statistics");
  }
  const auto& actions = schedule_.actions.at(rank_);
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const ActionType t = actions[i].type;
    TWOBP_CHECK(!options_.evaluate || t == ActionType::kForward || t == ActionType::kSendForward ||
                    t == ActionType::kRecvForward,
                ScheduleError, "rank {}: evaluation runs forward actions only, but schedule '{}' has {} (use "
                "forward_only())", rank_, schedule_.name, describe(actions[i]));
    if (is_receive(actions[i].type)) {
      recv_actions_.push_back(i);
    }
  }
}

Executor::~Executor() = default;

void Executor::note(RankStatus::State state, const Action* action, int peer, std::string detail) {
  std::lock_guard<std::mutex> lock(activity_->mutex);
  activity_->state = state;
  activity_->action = action ? std::optional<Action>(*action) : std::nullopt;
  activity_->peer = peer;
  activity_->since = Clock::now();
  activity_->detail = std::move(detail);
}

// Asks every rank of the pipeline what it is doing (bounded: a rank that cannot answer is reported as such) and
// builds the report; empty without a board. Called on the rank whose own wait timed out, before it aborts, so the
// abort carries the report to everyone.
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
    return board_->agree_on_report(run, hang_report(statuses, rank_));
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

namespace {

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

Executor::MemoryKey Executor::memory_key(const Step& st, ActionType type, int stage_index) {
  const bool weights = type == ActionType::kBackwardWeight || type == ActionType::kBackward;
  return {type, stage_index, weights && st.weights_started.count(stage_index) == 0};
}

// The most an action of this kind added (`table`: while it ran, or by its end) in this step or an earlier one;
// for a kind not seen yet, the same type and stage with the other gradient flag (a W not seen as a later W of its
// stage yet is bounded by that stage's first W, which also allocated the gradients), else the most of any kind.
int64_t Executor::expected(const std::map<MemoryKey, int64_t>& table, const MemoryKey& key) {
  if (auto it = table.find(key); it != table.end()) return it->second;
  const auto& [type, stage_index, first] = key;
  if (auto it = table.find({type, stage_index, !first}); it != table.end()) return it->second;
  int64_t most = 0;
  for (const auto& [k, v] : table) most = std::max(most, v);
  return most;
}

// Bounded in bytes (ExecutorOptions::memory_limit_bytes). Before `next`, the rank needs room for it and, after it,
// for its oldest deferred W -- so that the W can still run later, when waiting longer would have piled up more
// deferred work than fits. While either is expected not to fit, the oldest deferred W runs now (an event of its
// own), provided that it fits itself or at least rises less than `next` would (otherwise running it would reach
// as high as letting `next` run: the limit is then beyond what moving W's can reach).
void Executor::make_room(Step& st, const Action& next) {
  const int64_t limit = options_.memory_limit_bytes;
  if (limit <= 0) return;
  const MemoryKey next_key = memory_key(st, next.type, next.stage);
  const int64_t rise_next = expected(memory_rise_, next_key);
  const int64_t added_next = std::max<int64_t>(0, expected(memory_added_, next_key));
  const c10::Device device = memory_device();
  while (!st.pending_weight.empty()) {
    const auto [oldest_stage, oldest_mb] = st.pending_weight.front();
    const int64_t rise_w = expected(memory_rise_, memory_key(st, ActionType::kBackwardWeight, oldest_stage));
    const int64_t current = memory::allocated(device).current;
    if (current + std::max(rise_next, added_next + rise_w) <= limit) return;
    if (current + rise_w > limit && rise_w >= rise_next) return;
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
  const c10::Device device = memory_device();
  const MemoryKey key = memory_key(st, a.type, a.stage);
  int64_t before = -1;
  if (st.record_memory) {
    memory::reset_peak(device);
    before = memory::allocated(device).current;
  }
  note(RankStatus::State::kComputing, &a);
  if (scheduled) {
    const bool is_recv = is_receive(a.type);
    prefetch(st, is_recv ? st.index : 0);
  }
  const Clock::time_point t0 = Clock::now();
  st.timeline->begin_action();
  if (scheduled) {
    locate(st.failed_in, [&] { return st.where(rank_, a); },
           [&] { (this->*kHandlers[static_cast<int>(a.type)])(st, a); });
  } else {
    run_weight_early(st, a.stage, a.micro_batches.at(0));
  }
  if (a.type == ActionType::kBackwardWeight || a.type == ActionType::kBackward) st.weights_started.insert(a.stage);
  st.timeline->end_action();
  TraceEvent event{rank_, a, std::chrono::duration<double, std::micro>(t0 - st.start).count(),
                   detail::elapsed_us(st.start), is_compute(a.type) ? stage(a).take_recompute_us() : 0.0};
  if (st.record_memory) {
    const memory::Allocated now = memory::allocated(device);
    event.memory_before = before;
    event.memory_after = now.current;
    event.memory_peak = now.peak;
    st.result.peak_memory_bytes = std::max(st.result.peak_memory_bytes, now.peak);
    int64_t& rise = memory_rise_[key];
    rise = std::max(rise, now.peak - before);
    // What an action leaves behind may be negative (it can free more than it allocates), so no 0 default here.
    auto [added, fresh] = memory_added_.try_emplace(key, now.current - before);
    if (!fresh) added->second = std::max(added->second, now.current - before);
  }
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
  note(RankStatus::State::kComputing, &f);
  prefetch(st, 0);
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

c10::Device Executor::memory_device() const { return options_.memory_device.value_or(transport_.device()); }

BoundarySpec Executor::fixed_spec(int boundary) const {
  if (options_.boundary_spec) return options_.boundary_spec(boundary);
  if (options_.activation_spec) return {options_.activation_spec(boundary)};
  return {};
}

void Executor::send(Step& st, const Action& a) {
  const int mb = a.micro_batches[0];
  const bool fwd = a.type == ActionType::kSendForward;
  NamedTensors t = take(st, dependencies(a, schedule_.num_stages).needs.at(0), a);
  const int boundary = fwd ? a.stage : a.stage - 1, receiver = fwd ? a.stage + 1 : a.stage - 1;
  // Activations carry a gradient when they require grad (Stage::forward's contract); gradients are all "carried".
  std::vector<bool> gradient;
  for (auto& e : t) {
    gradient.push_back(!fwd || e.tensor.requires_grad());
    if (e.tensor.defined()) e.tensor = e.tensor.detach().contiguous();
  }
  const auto where = [&] {
    return fmt::format("{}: stage {} (rank {})", st.where(rank_, a), a.stage, rank_);
  };
  Step::PendingSend pending;
  if (const BoundarySpec spec_all = fixed_spec(boundary); !spec_all.empty()) {
    // The receiver allocated its buffers from the spec: a mismatch caught here is one that would otherwise
    // corrupt or hang the receiver. The error names the producing and the receiving stage.
    BoundarySpec spec;
    for (const auto& ts : spec_all) {
      if (fwd || ts.carries_gradient()) spec.push_back(ts);
    }
    bool same = t.size() == spec.size();
    for (std::size_t i = 0; same && i < spec.size(); ++i) {
      const at::Tensor& x = t.entry(i).tensor;
      same = t.entry(i).name == spec[i].name && x.defined() && x.sizes().vec() == spec[i].shape &&
             x.scalar_type() == spec[i].dtype &&
             // Evaluation computes no gradient: whether an activation would carry one in training is moot.
             (!fwd || options_.evaluate || gradient[i] == spec[i].carries_gradient());
    }
    for (std::size_t i = 0; !fwd && i < t.size() && i < spec.size(); ++i) {
      TWOBP_CHECK(t.entry(i).tensor.defined(), UsageError,
                  "{}: no gradient reached input '{}' of micro-batch {} (no output of stage {} depends on it); with "
                  "fixed activation specs every tensor whose spec carries a gradient must get one: set "
                  "requires_grad = false in its spec (and detach it in stage {}), or give no specs -- announced "
                  "messages say which gradients are undefined",
                  where(), t.entry(i).name, mb, a.stage, receiver);
    }
    TWOBP_CHECK(same, UsageError, "{} produced {} {{{}}} for micro-batch {}, but stage {} (rank {}) expects {{{}}}",
                where(), fwd ? "activations" : "gradients", describe_announced(t, gradient), mb, receiver,
                schedule_.stage_to_rank[receiver], describe_spec(spec));
  } else {
    // Announced shapes: the header first, on its own channel, then the tensors that are present.
    at::Tensor header = detail::encode_header(detail::announce(t, gradient), where()).to(transport_.device());
    pending.works.push_back(
        transport_.isend(header,
                         message_options(schedule_, a, MessagePart::header(), options_.timeout, tag_offset_)));
    pending.tensors.push_back(std::move(header));
  }
  TWOBP_CHECK(static_cast<int>(t.size()) <= kMaxTensorsPerMessage, UsageError,
              "{} sends {} tensors ({{{}}}); a stage boundary carries at most {}", where(), t.size(), t.describe(),
              kMaxTensorsPerMessage);
  for (std::size_t i = 0; i < t.size(); ++i) {
    const at::Tensor& x = t.entry(i).tensor;
    if (!x.defined()) continue;
    pending.works.push_back(transport_.isend(
        x, message_options(schedule_, a, MessagePart{static_cast<int>(i)}, options_.timeout, tag_offset_)));
    pending.tensors.push_back(x);
  }
  st.sends.push_back(std::move(pending));
}

void Executor::post_tensors(Step& st, std::size_t index) {
  const Action& a = schedule_.actions[rank_][index];
  Step::PostedRecv& r = st.posted.at(index);
  if (r.header_work) {
    note(RankStatus::State::kWaiting, &a, peer_rank(schedule_, a));
    r.header_work->wait(options_.timeout);
    const auto& mine = schedule_.actions[rank_];  // back to the action that prefetched this receive
    note(RankStatus::State::kComputing, st.index < mine.size() ? &mine[st.index] : nullptr);
    r.layout = detail::decode_header(r.header, st.where(rank_, a));
    TWOBP_CHECK(static_cast<int>(r.layout.size()) <= kMaxTensorsPerMessage, TransportError,
                "{}: the shape header announces {} tensors, more than {}", st.where(rank_, a), r.layout.size(),
                kMaxTensorsPerMessage);
  }
  for (std::size_t i = 0; i < r.layout.size(); ++i) {
    const detail::AnnouncedTensor& t = r.layout[i];
    at::Tensor buffer;
    if (t.present) {
      buffer = at::empty(t.shape, at::TensorOptions().dtype(t.dtype).device(transport_.device()));
      r.works.push_back(transport_.irecv(
          buffer,
          message_options(schedule_, a, MessagePart{static_cast<int>(i)}, options_.timeout, tag_offset_)));
    }
    r.buffers.push_back(std::move(buffer));
  }
  r.tensors_posted = true;
}

void Executor::receive(Step& st, const Action& a) {
  auto it = st.posted.find(st.index);
  TWOBP_CHECK(it != st.posted.end(), ScheduleError, "{}: receive was not posted", st.where(rank_, a));
  if (!it->second.tensors_posted) post_tensors(st, st.index);
  Step::PostedRecv r = std::move(it->second);
  st.posted.erase(it);
  note(RankStatus::State::kWaiting, &a, peer_rank(schedule_, a));
  for (auto& w : r.works) w->wait(options_.timeout);
  const bool fwd = a.type == ActionType::kRecvForward;
  NamedTensors received;
  for (std::size_t i = 0; i < r.layout.size(); ++i) {
    at::Tensor& t = r.buffers[i];
    // An activation that carries a gradient arrives as a leaf that requires grad, as the sender's Stage returned it.
    if (fwd && t.defined() && r.layout[i].carries_gradient && t.is_floating_point()) t.requires_grad_(true);
    received.add(r.layout[i].name, std::move(t));
  }
  // Filed under the producing stage, exactly where a local producer would have put it.
  put(st.mailbox, dependencies(a, schedule_.num_stages).produces.at(0), std::move(received));
}

void Executor::prefetch(Step& st, std::size_t up_to_inclusive) {
  // Keep up to prefetch_receives receives in flight, and always post the one about to be waited on.
  //
  // On a transport whose posted receives hold the device (NCCL) a receive is not posted ahead of this rank's own
  // SENDs that precede it and are not posted yet. WHY: some host calls wait for the device to go idle -- loading a
  // kernel module, cudaFree (the caching allocator frees its cache and retries when cudaMalloc fails near the
  // memory limit), cudaDeviceSynchronize -- and so wait for every posted receive. A receive whose data the peer can
  // send only after one of our later sends would then never complete: a deadlock inside the driver, which no
  // timeout of ours can end (seen on an H200, 2026-12-04: rank 0 blocked in such a call beside its posted gradient
  // receives, before it had sent its first activation). In a schedule that validate() accepts, every receive
  // depends only on sends that precede it on this rank, so a receive posted after them completes without this
  // rank doing anything more. The cost is small: in steady state a RECV follows a SEND anyway, and a late receive
  // exposes one transfer instead of overlapping it.
  const auto& actions = schedule_.actions[rank_];
  const bool hold_back = transport_.receives_hold_device();
  const auto unsent_before = [&](std::size_t recv_index) {
    for (std::size_t k = st.index; k < recv_index; ++k) {
      if (is_send(actions[k].type)) return true;
    }
    return false;
  };
  while (st.next_recv < recv_actions_.size() &&
         (recv_actions_[st.next_recv] <= up_to_inclusive ||
          (static_cast<int>(st.posted.size()) < options_.prefetch_receives &&
           !(hold_back && unsent_before(recv_actions_[st.next_recv]))))) {
    const std::size_t index = recv_actions_[st.next_recv++];
    const Action& a = actions[index];
    const bool fwd = a.type == ActionType::kRecvForward;
    Step::PostedRecv r;
    const BoundarySpec spec = fixed_spec(fwd ? a.stage - 1 : a.stage);
    if (spec.empty()) {
      r.header = at::empty({detail::kHeaderSlots}, at::TensorOptions().dtype(at::kLong).device(transport_.device()));
      r.header_work = transport_.irecv(
          r.header, message_options(schedule_, a, MessagePart::header(), options_.timeout, tag_offset_));
    } else {
      for (const auto& ts : spec) {
        if (fwd || ts.carries_gradient()) {
          r.layout.push_back({ts.name, true, ts.carries_gradient(), ts.dtype, ts.shape});
        }
      }
    }
    st.posted.emplace(index, std::move(r));
    if (!spec.empty()) post_tensors(st, index);
  }
  // Announced shapes: post the tensors of messages whose header arrived, in action order (in-order transports
  // pair each channel's messages in posting order). On a GPU reading a header waits for the device, so there the
  // tensors are posted by the RECV itself.
  if (!transport_.device().is_cpu()) return;
  for (auto& [index, r] : st.posted) {
    if (r.tensors_posted) continue;
    if (!r.header_work->is_completed()) break;
    post_tensors(st, index);
  }
}

namespace {

// The rows (size of dimension 0, the dimension batches are split along) that every tensor of `batch` has; -1 when
// it has no tensor of dimension >= 1. Tensors that disagree would be split into pieces of different sizes, which
// broadcasting can then combine silently (a mask of 1 row against activations of 2): refused, naming them all.
int64_t common_rows(const NamedTensors& batch, const std::string& what) {
  int64_t rows = -1;
  bool agree = true;
  for (const auto& [name, t] : batch) {
    if (!t.defined() || t.dim() == 0) continue;
    if (rows < 0) rows = t.size(0);
    agree = agree && t.size(0) == rows;
  }
  if (!agree) {
    std::string sizes;
    for (const auto& [name, t] : batch) {
      if (!t.defined() || t.dim() == 0) continue;
      sizes += fmt::format("{}'{}': {}", sizes.empty() ? "" : ", ", name, t.size(0));
    }
    throw UsageError(fmt::format("{}: the tensors disagree on their number of rows (dimension 0, along which a "
                                 "batch is split into micro-batches): {}; give every tensor one row per sample",
                                 what, sizes));
  }
  return rows;
}

// Inputs and targets of one (micro-)batch, when this rank holds both the first and the last stage: one row each
// per sample.
void check_inputs_match_targets(const NamedTensors& inputs, const NamedTensors& targets, const std::string& what) {
  const int64_t in = common_rows(inputs, what + "'s inputs"), out = common_rows(targets, what + "'s targets");
  TWOBP_CHECK(in < 0 || out < 0 || in == out, UsageError,
              "{}: the inputs have {} rows ({{{}}}) and the targets {} ({{{}}}); they must describe the same samples",
              what, in, inputs.describe(), out, targets.describe());
}

}  // namespace

StepResult Executor::run(const NamedTensors& inputs, const NamedTensors& targets) {
  const int m = schedule_.num_micro_batches, last = schedule_.num_stages - 1;
  auto split_batch = [&](const NamedTensors& batch, int stage_index, const char* what) {
    std::vector<NamedTensors> out(stages_.count(stage_index) ? m : 0);
    if (out.empty()) return out;
    TWOBP_CHECK(!batch.empty(), UsageError, "rank {}: owns stage {} and needs the {} of the batch, got none", rank_,
                stage_index, what);
    common_rows(batch, fmt::format("rank {} stage {}: the batch's {}", rank_, stage_index, what));
    for (const auto& [name, t] : batch) {
      TWOBP_CHECK(t.defined() && t.dim() > 0 && t.size(0) % m == 0, UsageError,
                  "rank {}: {} '{}' with {} samples cannot be split into {} micro-batches of equal size; pass the "
                  "micro-batches one by one to split them unevenly",
                  rank_, what, name, t.defined() && t.dim() > 0 ? t.size(0) : 0, m);
      const auto pieces = t.split(t.size(0) / m);
      for (int k = 0; k < m; ++k) out[k].add(name, pieces[k]);
    }
    return out;
  };
  std::vector<NamedTensors> input_mbs, target_mbs;
  try {
    if (stages_.count(0) && stages_.count(last)) {
      check_inputs_match_targets(inputs, targets, fmt::format("rank {}: the batch", rank_));
    }
    input_mbs = split_batch(inputs, 0, "inputs");
    target_mbs = split_batch(targets, last, "targets");
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
  const int m = schedule_.num_micro_batches, last = schedule_.num_stages - 1;
  const auto& actions = schedule_.actions[rank_];
  failure_reason_.clear();
  // Every rank runs the same runs in the same order, so they agree on the run number without a message.
  const std::int64_t run_number = (*options_.run_counter)++;
  tag_offset_ = run_number * message_tag_span(schedule_);
  {
    std::lock_guard<std::mutex> lock(activity_->mutex);
    activity_->run = run_number;
  }
  // The running executor answers for this rank (a pipeline's training and evaluation executors take turns).
  if (board_) board_->attach(rank_, [activity = activity_] { return activity->text(); });
  Step st;
  StepResult& result = st.result;
  st.start = Clock::now();
  DeviceTimeline timeline(transport_.device());
  st.timeline = &timeline;
  st.record_memory = options_.record_memory || options_.memory_limit_bytes > 0;

  auto micro_batches = [&](const std::vector<NamedTensors>& given, int stage_index, const char* what) {
    TWOBP_CHECK(static_cast<int>(given.size()) == m, UsageError,
                "rank {}: owns stage {} and needs the {} of {} micro-batches, got {}", rank_, stage_index, what, m,
                given.size());
    for (int k = 0; k < m; ++k) {
      TWOBP_CHECK(!given[k].empty(), UsageError, "rank {}: stage {} micro-batch {}: no {} given", rank_, stage_index,
                  k, what);
      common_rows(given[k], fmt::format("rank {} stage {} micro-batch {}: the {}", rank_, stage_index, k, what));
    }
    return given;
  };

  try {
    if (stages_.count(0)) st.input_mbs = micro_batches(inputs, 0, "inputs");
    if (stages_.count(last)) {
      st.target_mbs = micro_batches(targets, last, "targets");
      st.losses.resize(m);
    }
    if (stages_.count(0) && stages_.count(last)) {
      for (int k = 0; k < m; ++k) {
        check_inputs_match_targets(st.input_mbs[k], st.target_mbs[k], fmt::format("rank {} micro-batch {}", rank_, k));
      }
    }
    for (st.index = 0; st.index < actions.size(); ++st.index) {
      const Action& a = actions[st.index];
      if (a.overlapped_with_next && options_.overlap_forward_backward) {
        execute_pair(st, a, actions[st.index + 1]);  // the constructor checked that the B is next
        ++st.index;
      } else {
        make_room(st, a);
        execute(st, a, /*scheduled=*/true);
      }
      // Completed sends are retired as we go so their buffers do not pile up over a long step.
      while (!st.sends.empty() && st.sends.front().completed()) st.sends.pop_front();
    }
    note(RankStatus::State::kWaiting, nullptr, -1, "its last sends of the step to be received");
    for (auto& s : st.sends) {
      for (auto& w : s.works) w->wait(options_.timeout);
    }
    st.sends.clear();
    if (!st.losses.empty()) {
      // SYNC POINT: the step's only device-to-host copy on the last stage (not one per micro-batch).
      const at::Tensor host = at::cat(st.losses).to(at::kDouble).cpu();
      result.losses.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
    }
    for (const auto& [index, stage_ptr] : stages_) {
      TWOBP_CHECK(stage_ptr->live_micro_batches() == 0, ScheduleError,
                  "rank {}: stage {} ended the step with {} micro-batches whose backward did not finish", rank_, index,
                  stage_ptr->live_micro_batches());
    }
  } catch (const std::exception& e) {
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
      note(RankStatus::State::kFailed, nullptr, -1, detail::placed(what.substr(0, what.find('\n')), failed_in));
    }
    for (auto& [index, stage_ptr] : stages_) stage_ptr->reset();
    st = Step{};
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
  note(RankStatus::State::kOutsideStep, nullptr);
  result.trace.step_us = detail::elapsed_us(st.start);
  timeline.apply(result.trace);
  return std::move(result);
}

}  // namespace twobp
