#include "twobp/runtime/executor.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>
#include <set>
#include <tuple>
#include <utility>

#include "twobp/schedule/dependencies.h"
#include "util/check.h"
#include "util/format.h"
#include "util/time.h"

namespace twobp {
namespace {

// The tensors that travel between actions (dependencies() also names what stays inside a Stage: its saved graph
// and pending weight work) are the activations and input gradients.
bool travels(const ItemRef& it) { return it.item == Item::kActivation || it.item == Item::kInputGrad; }

// The same tag and channel on both sides of a message; the label names the action on *this* side.
P2POptions message_options(const Schedule& schedule, const Action& a, Duration timeout) {
  P2POptions o;
  o.peer = peer_rank(schedule, a);
  o.tag = message_tag(schedule, a);
  o.label = describe(a);
  o.channel = message_channel(a);
  o.timeout = timeout;
  return o;
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
  void end_action() {
    if (enabled_) actions_.emplace_back(std::move(begin_), record());
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
  std::unique_ptr<c10::Event> record() {
    auto e = std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    e->record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
    return e;
  }
  c10::Device device_;
  bool enabled_;
  std::unique_ptr<c10::Event> step_, begin_;
  std::vector<std::pair<std::unique_ptr<c10::Event>, std::unique_ptr<c10::Event>>> actions_;
};

}  // namespace

// The state of one step. Everything is keyed by (item, stage, micro-batch), so the executor follows any valid
// schedule without knowing which one it is.
struct Executor::Step {
  struct PostedRecv {
    at::Tensor buffer;
    std::unique_ptr<Work> work;
  };
  struct PendingSend {
    at::Tensor tensor;  // kept alive until the transport is done with it
    std::unique_ptr<Work> work;
  };

  std::map<std::tuple<Item, int, int>, at::Tensor> mailbox;  // (item, stage, micro-batch)
  std::map<std::size_t, PostedRecv> posted;  // by action index
  std::deque<PendingSend> sends;
  std::size_t next_recv = 0;  // into recv_actions_
  std::size_t index = 0;      // of the action being executed
  std::vector<at::Tensor> input_mbs, target_mbs;
  // Memory-bounded 2BP: per stage, micro-batches whose I ran and W did not, oldest first; and the W's run early.
  std::map<int, std::deque<int>> pending_weight;
  std::set<std::pair<int, int>> early_weight;  // (stage, micro-batch)
  std::vector<at::Tensor> losses;  // on the device until the step ends

  std::string where(int rank, const Action& a) const { return fmt::format("rank {}: {}", rank, describe(a)); }
};

Executor::Executor(const Schedule& schedule, int rank, std::map<int, Stage*> stages, Transport& transport,
                   ExecutorOptions options)
    : schedule_(schedule), rank_(rank), stages_(std::move(stages)), transport_(transport),
      options_(std::move(options)) {
  const auto& actions = schedule_.actions.at(rank_);
  for (std::size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].type == ActionType::kRecvForward || actions[i].type == ActionType::kRecvBackward) {
      recv_actions_.push_back(i);
    }
  }
}

Executor::~Executor() = default;

void Executor::add_hook(Hook hook) { hooks_.push_back(std::move(hook)); }

Stage& Executor::stage(const Action& a) {
  auto it = stages_.find(a.stage);
  TWOBP_CHECK(it != stages_.end(), ScheduleError, "rank {}: {}: stage {} is not on this rank", rank_, describe(a),
              a.stage);
  return *it->second;
}

namespace {

void put(std::map<std::tuple<Item, int, int>, at::Tensor>& mailbox, const ItemRef& it, at::Tensor t) {
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
at::Tensor Executor::take(Step& st, const ItemRef& it, const Action& a) {
  auto found = st.mailbox.find({it.item, it.stage, it.micro_batch});
  TWOBP_CHECK(found != st.mailbox.end(), ScheduleError,
              "{}: {} is not available (an action that produces it must come first: schedule order bug)",
              st.where(rank_, a), describe(it));
  at::Tensor t = std::move(found->second);
  st.mailbox.erase(found);
  return t;
}

// The items each handler takes and puts come from dependencies(), the one table of action meaning.
void Executor::forward(Step& st, const Action& a) {
  const int mb = a.micro_batches[0], last = schedule_.num_stages - 1;
  const ActionDependencies deps = dependencies(a, schedule_.num_stages);
  const ItemRef* in = travelling(deps.needs);
  at::Tensor input = in == nullptr ? st.input_mbs.at(mb) : take(st, *in, a);
  at::Tensor out = stage(a).forward(mb, input, a.stage == last ? st.target_mbs.at(mb) : at::Tensor());
  if (const ItemRef* made = travelling(deps.produces)) {
    put(st.mailbox, *made, std::move(out));
  } else {
    st.losses[mb] = out.detach().reshape({1});  // the last stage's output is its loss
  }
}

void Executor::backward(Step& st, const Action& a) {
  const int mb = a.micro_batches[0];
  const ActionDependencies deps = dependencies(a, schedule_.num_stages);
  const ItemRef* in = travelling(deps.needs);
  const at::Tensor grad_output = in == nullptr ? at::Tensor() : take(st, *in, a);
  Stage& s = stage(a);
  at::Tensor grad_input =
      a.type == ActionType::kBackward ? s.backward(mb, grad_output) : s.backward_input(mb, grad_output);
  if (const ItemRef* made = travelling(deps.produces)) put(st.mailbox, *made, std::move(grad_input));
  const int limit = options_.max_pending_weight_micro_batches;
  if (a.type == ActionType::kBackwardInput && limit > 0) {
    auto& pending = st.pending_weight[a.stage];
    pending.push_back(mb);
    while (static_cast<int>(pending.size()) > limit) {
      const int oldest = pending.front();
      pending.pop_front();
      s.backward_weight({oldest});
      st.early_weight.insert({a.stage, oldest});
    }
  }
}

void Executor::backward_weight(Step& st, const Action& a) {
  std::vector<int> mbs;  // the action's micro-batches whose W did not run early
  for (int mb : a.micro_batches) {
    if (st.early_weight.erase({a.stage, mb}) != 0) continue;
    mbs.push_back(mb);
    auto& pending = st.pending_weight[a.stage];
    pending.erase(std::remove(pending.begin(), pending.end(), mb), pending.end());
  }
  stage(a).backward_weight(mbs,
                           options_.parameters_done ? options_.parameters_done(st.index) : autograd::ParametersDone());
}

void Executor::send(Step& st, const Action& a) {
  const int mb = a.micro_batches[0];
  const bool fwd = a.type == ActionType::kSendForward;
  at::Tensor t = take(st, dependencies(a, schedule_.num_stages).needs.at(0), a).contiguous();
  // The receiver allocated its buffer from the boundary's spec: a mismatch caught here is one that would otherwise
  // corrupt or hang the receiver. The error names the producing and the receiving stage.
  const int boundary = fwd ? a.stage : a.stage - 1, receiver = fwd ? a.stage + 1 : a.stage - 1;
  const TensorSpec spec = options_.activation_spec(boundary);
  TWOBP_CHECK(t.sizes().vec() == spec.shape && t.scalar_type() == spec.dtype, UsageError,
              "{}: stage {} (rank {}) produced {} {} for micro-batch {}, but stage {} (rank {}) expects {}",
              st.where(rank_, a), a.stage, rank_, fwd ? "activations" : "gradients",
              detail::describe_shape(t.sizes(), t.scalar_type()), mb, receiver, schedule_.stage_to_rank[receiver],
              detail::describe_shape(spec.shape, spec.dtype));
  auto work = transport_.isend(t, message_options(schedule_, a, options_.timeout));
  st.sends.push_back({std::move(t), std::move(work)});
}

void Executor::receive(Step& st, const Action& a) {
  auto it = st.posted.find(st.index);
  TWOBP_CHECK(it != st.posted.end(), ScheduleError, "{}: receive was not posted", st.where(rank_, a));
  it->second.work->wait(options_.timeout);
  at::Tensor buffer = std::move(it->second.buffer);
  st.posted.erase(it);
  // Filed under the producing stage, exactly where a local producer would have put it.
  put(st.mailbox, dependencies(a, schedule_.num_stages).produces.at(0), std::move(buffer));
}

void Executor::prefetch(Step& st, std::size_t up_to_inclusive) {
  // Keep up to prefetch_receives receives in flight, and always post the one about to be waited on.
  const auto& actions = schedule_.actions[rank_];
  while (st.next_recv < recv_actions_.size() &&
         (recv_actions_[st.next_recv] <= up_to_inclusive ||
          static_cast<int>(st.posted.size()) < options_.prefetch_receives)) {
    const std::size_t index = recv_actions_[st.next_recv++];
    const Action& a = actions[index];
    const TensorSpec spec = options_.activation_spec(a.type == ActionType::kRecvForward ? a.stage - 1 : a.stage);
    Step::PostedRecv r;
    r.buffer = at::empty(spec.shape, at::TensorOptions().dtype(spec.dtype).device(transport_.device()));
    r.work = transport_.irecv(r.buffer, message_options(schedule_, a, options_.timeout));
    st.posted.emplace(index, std::move(r));
  }
}

StepResult Executor::run(const at::Tensor& inputs, const at::Tensor& targets) {
  using Handler = void (Executor::*)(Step&, const Action&);
  static constexpr Handler kHandlers[] = {
      &Executor::forward,  // kForward
      &Executor::backward,  // kBackwardInput
      &Executor::backward_weight,  // kBackwardWeight
      &Executor::backward,  // kBackward
      &Executor::send,     // kSendForward
      &Executor::receive,  // kRecvForward
      &Executor::send,     // kSendBackward
      &Executor::receive,  // kRecvBackward
  };
  const int m = schedule_.num_micro_batches, last = schedule_.num_stages - 1;
  const auto& actions = schedule_.actions[rank_];
  Step st;
  StepResult result;
  const Clock::time_point start = Clock::now();
  DeviceTimeline timeline(transport_.device());

  auto split_batch = [&](const at::Tensor& batch, int stage_index, const char* what) {
    TWOBP_CHECK(batch.defined(), UsageError, "rank {}: owns stage {} and needs the {} of the batch, got none", rank_,
                stage_index, what);
    TWOBP_CHECK(batch.dim() > 0 && batch.size(0) % m == 0, UsageError,
                "rank {}: {} with {} samples cannot be split into {} micro-batches of equal size", rank_, what,
                batch.dim() > 0 ? batch.size(0) : 0, m);
    return batch.split(batch.size(0) / m);
  };

  try {
    if (stages_.count(0)) st.input_mbs = split_batch(inputs, 0, "inputs");
    if (stages_.count(last)) {
      st.target_mbs = split_batch(targets, last, "targets");
      st.losses.resize(m);
    }
    for (st.index = 0; st.index < actions.size(); ++st.index) {
      const Action& a = actions[st.index];
      const bool is_recv = a.type == ActionType::kRecvForward || a.type == ActionType::kRecvBackward;
      prefetch(st, is_recv ? st.index : 0);
      const Clock::time_point t0 = Clock::now();
      timeline.begin_action();
      (this->*kHandlers[static_cast<int>(a.type)])(st, a);
      timeline.end_action();
      result.trace.events.push_back(
          TraceEvent{rank_, a, std::chrono::duration<double, std::micro>(t0 - start).count(), detail::elapsed_us(start)});
      if (!hooks_.empty()) {
        const ActionEvent event{rank_, &a, is_compute(a.type) ? &stage(a) : nullptr};
        for (const auto& hook : hooks_) hook(event);
      }
      // Completed sends are retired as we go so their buffers do not pile up over a long step.
      while (!st.sends.empty() && st.sends.front().work->is_completed()) st.sends.pop_front();
    }
    for (auto& s : st.sends) s.work->wait(options_.timeout);
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
    for (auto& [index, stage_ptr] : stages_) stage_ptr->reset();
    st = Step{};
    // Tell every peer now: they would otherwise wait for their timeout on messages this rank will never send.
    try {
      transport_.abort(fmt::format("rank {} failed: {}", rank_, e.what()));
    } catch (...) {
    }
    throw;
  }
  result.trace.step_us = detail::elapsed_us(start);
  timeline.apply(result.trace);
  return result;
}

}  // namespace twobp
