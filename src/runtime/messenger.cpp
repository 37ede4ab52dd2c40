#include "runtime/messenger.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <utility>

#include "twobp/schedule/dependencies.h"
#include "twobp/schedule/messages.h"
#include "util/check.h"
#include "util/format.h"

namespace twobp::detail {
namespace {

// "name [2, 3] Double" or "name [2, 3] Bool (no gradient)", joined by ", ": how boundary errors list tensors.
std::string describe_entry(const std::string& name, const std::string& shape, bool gradient) {
  return fmt::format("{} {}{}", name.empty() ? std::string("tensor") : name, shape, gradient ? "" : " (no gradient)");
}

std::string describe_spec(const BoundarySpec& spec) {
  std::vector<std::string> parts;
  for (const auto& t : spec) {
    parts.push_back(describe_entry(t.name, describe_shape(t.shape, t.dtype), t.carries_gradient()));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string describe_announced(const NamedTensors& t, const std::vector<bool>& gradient) {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < t.size(); ++i) {
    const auto& [name, tensor] = t.entry(i);
    parts.push_back(describe_entry(
        name, tensor.defined() ? describe_shape(tensor.sizes(), tensor.scalar_type()) : "undefined", gradient[i]));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string where(int rank, const Action& a) { return fmt::format("rank {}: {}", rank, describe(a)); }

}  // namespace

bool Messenger::PendingSend::completed() const {
  return std::all_of(works.begin(), works.end(), [](const auto& w) { return w->is_completed(); });
}

Messenger::Messenger(const Schedule& schedule, int rank, Transport& transport, const ExecutorOptions& options,
                     RankActivity& activity)
    : schedule_(schedule), rank_(rank), transport_(transport), options_(options), activity_(activity) {
  const auto& actions = schedule_.actions.at(rank_);
  for (std::size_t i = 0; i < actions.size(); ++i) {
    if (is_receive(actions[i].type)) recv_actions_.push_back(i);
  }
}

void Messenger::start_step(std::int64_t tag_offset) {
  clear();
  tag_offset_ = tag_offset;
}

void Messenger::clear() {
  posted_.clear();
  sends_.clear();
  next_recv_ = 0;
}

// The same tag and channel on both sides of a message; the label names the action on *this* side.
P2POptions Messenger::message_options(const Action& a, MessagePart part) const {
  P2POptions o;
  o.peer = peer_rank(schedule_, a);
  o.tag = message_tag(schedule_, a, part) + tag_offset_;
  o.label = part.is_header() ? describe(a) + " (shape header)"
                             : part.tensor == 0 ? describe(a) : fmt::format("{} (tensor {})", describe(a), part.tensor);
  o.channel = message_channel(a, part);
  o.timeout = options_.timeout;
  return o;
}

BoundarySpec Messenger::fixed_spec(int boundary) const {
  if (options_.boundary_spec) return options_.boundary_spec(boundary);
  if (options_.activation_spec) return {options_.activation_spec(boundary)};
  return {};
}

// The receiver allocated its buffers from the spec: a mismatch caught here is one that would otherwise corrupt or
// hang the receiver. The error names the producing and the receiving stage.
void Messenger::check_against_spec(const Action& a, const NamedTensors& t, const std::vector<bool>& gradient,
                                   const BoundarySpec& spec_all) const {
  const int mb = a.micro_batches[0];
  const bool fwd = a.type == ActionType::kSendForward;
  const int receiver = fwd ? a.stage + 1 : a.stage - 1;
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
  const std::string sender = fmt::format("{}: stage {} (rank {})", where(rank_, a), a.stage, rank_);
  for (std::size_t i = 0; !fwd && i < t.size() && i < spec.size(); ++i) {
    TWOBP_CHECK(t.entry(i).tensor.defined(), UsageError,
                "{}: no gradient reached input '{}' of micro-batch {} (no output of stage {} depends on it); with "
                "fixed activation specs every tensor whose spec carries a gradient must get one: set "
                "requires_grad = false in its spec (and detach it in stage {}), or give no specs -- announced "
                "messages say which gradients are undefined",
                sender, t.entry(i).name, mb, a.stage, receiver);
  }
  TWOBP_CHECK(same, UsageError, "{} produced {} {{{}}} for micro-batch {}, but stage {} (rank {}) expects {{{}}}",
              sender, fwd ? "activations" : "gradients", describe_announced(t, gradient), mb, receiver,
              schedule_.stage_to_rank[receiver], describe_spec(spec));
}

void Messenger::send(const Action& a, NamedTensors t) {
  const bool fwd = a.type == ActionType::kSendForward;
  const int boundary = fwd ? a.stage : a.stage - 1;
  // Activations carry a gradient when they require grad (Stage::forward's contract); gradients are all "carried".
  std::vector<bool> gradient;
  for (auto& e : t) {
    gradient.push_back(!fwd || e.tensor.requires_grad());
    if (e.tensor.defined()) e.tensor = e.tensor.detach().contiguous();
  }
  const auto sender = [&] { return fmt::format("{}: stage {} (rank {})", where(rank_, a), a.stage, rank_); };
  PendingSend pending;
  if (const BoundarySpec spec = fixed_spec(boundary); !spec.empty()) {
    check_against_spec(a, t, gradient, spec);
  } else {
    // Announced shapes: the header first, on its own channel, then the tensors that are present.
    at::Tensor header = encode_header(announce(t, gradient), sender()).to(transport_.device());
    pending.works.push_back(transport_.isend(header, message_options(a, MessagePart::header())));
    pending.tensors.push_back(std::move(header));
  }
  TWOBP_CHECK(static_cast<int>(t.size()) <= kMaxTensorsPerMessage, UsageError,
              "{} sends {} tensors ({{{}}}); a stage boundary carries at most {}", sender(), t.size(), t.describe(),
              kMaxTensorsPerMessage);
  for (std::size_t i = 0; i < t.size(); ++i) {
    const at::Tensor& x = t.entry(i).tensor;
    if (!x.defined()) continue;
    pending.works.push_back(transport_.isend(x, message_options(a, MessagePart{static_cast<int>(i)})));
    pending.tensors.push_back(x);
  }
  sends_.push_back(std::move(pending));
}

void Messenger::post_tensors(std::size_t current, std::size_t index) {
  const auto& actions = schedule_.actions[rank_];
  const Action& a = actions[index];
  PostedRecv& r = posted_.at(index);
  if (r.header_work) {
    activity_.note(RankStatus::State::kWaiting, &a, peer_rank(schedule_, a));
    r.header_work->wait(options_.timeout);
    // Back to the action that prefetched this receive.
    activity_.note(RankStatus::State::kComputing, current < actions.size() ? &actions[current] : nullptr);
    r.layout = decode_header(r.header, where(rank_, a));
    TWOBP_CHECK(static_cast<int>(r.layout.size()) <= kMaxTensorsPerMessage, TransportError,
                "{}: the shape header announces {} tensors, more than {}", where(rank_, a), r.layout.size(),
                kMaxTensorsPerMessage);
  }
  for (std::size_t i = 0; i < r.layout.size(); ++i) {
    const AnnouncedTensor& t = r.layout[i];
    at::Tensor buffer;
    if (t.present) {
      buffer = at::empty(t.shape, at::TensorOptions().dtype(t.dtype).device(transport_.device()));
      r.works.push_back(transport_.irecv(buffer, message_options(a, MessagePart{static_cast<int>(i)})));
    }
    r.buffers.push_back(std::move(buffer));
  }
  r.tensors_posted = true;
}

NamedTensors Messenger::receive(std::size_t index) {
  const Action& a = schedule_.actions[rank_][index];
  auto it = posted_.find(index);
  TWOBP_CHECK(it != posted_.end(), ScheduleError, "{}: receive was not posted", where(rank_, a));
  if (!it->second.tensors_posted) post_tensors(index, index);
  PostedRecv r = std::move(it->second);
  posted_.erase(it);
  activity_.note(RankStatus::State::kWaiting, &a, peer_rank(schedule_, a));
  for (auto& w : r.works) w->wait(options_.timeout);
  const bool fwd = a.type == ActionType::kRecvForward;
  NamedTensors received;
  for (std::size_t i = 0; i < r.layout.size(); ++i) {
    at::Tensor& t = r.buffers[i];
    // An activation that carries a gradient arrives as a leaf that requires grad, as the sender's Stage returned it.
    if (fwd && t.defined() && r.layout[i].carries_gradient && t.is_floating_point()) t.requires_grad_(true);
    received.add(r.layout[i].name, std::move(t));
  }
  return received;
}

void Messenger::prefetch(std::size_t current, std::size_t up_to_inclusive) {
  // Keep up to prefetch_receives receives in flight, and always post the one about to be waited on.
  //
  // On a transport whose posted receives hold the device (NCCL) a receive is not posted ahead of this rank's own
  // SENDs that precede it and are not posted yet. WHY: some host calls wait for the device to go idle -- loading a
  // kernel module, cudaFree (the caching allocator frees its cache and retries when cudaMalloc fails near the
  // memory limit), cudaDeviceSynchronize -- and so wait for every posted receive. A receive whose data the peer can
  // send only after one of our later sends would then never complete: a deadlock inside the driver, which no
  // timeout of ours can end (seen on an H200, docs/GPU.md: rank 0 blocked in such a call beside its posted gradient
  // receives, before it had sent its first activation). In a schedule that validate() accepts, every receive
  // depends only on sends that precede it on this rank, so a receive posted after them completes without this
  // rank doing anything more. The cost is small: in steady state a RECV follows a SEND anyway, and a late receive
  // exposes one transfer instead of overlapping it.
  const auto& actions = schedule_.actions[rank_];
  const bool hold_back = transport_.receives_hold_device();
  const auto unsent_before = [&](std::size_t recv_index) {
    for (std::size_t k = current; k < recv_index; ++k) {
      if (is_send(actions[k].type)) return true;
    }
    return false;
  };
  while (next_recv_ < recv_actions_.size() &&
         (recv_actions_[next_recv_] <= up_to_inclusive ||
          (static_cast<int>(posted_.size()) < options_.prefetch_receives &&
           !(hold_back && unsent_before(recv_actions_[next_recv_]))))) {
    const std::size_t index = recv_actions_[next_recv_++];
    const Action& a = actions[index];
    const bool fwd = a.type == ActionType::kRecvForward;
    PostedRecv r;
    const BoundarySpec spec = fixed_spec(fwd ? a.stage - 1 : a.stage);
    if (spec.empty()) {
      r.header = at::empty({kHeaderSlots}, at::TensorOptions().dtype(at::kLong).device(transport_.device()));
      r.header_work = transport_.irecv(r.header, message_options(a, MessagePart::header()));
    } else {
      for (const auto& ts : spec) {
        if (fwd || ts.carries_gradient()) {
          r.layout.push_back({ts.name, true, ts.carries_gradient(), ts.dtype, ts.shape});
        }
      }
    }
    posted_.emplace(index, std::move(r));
    if (!spec.empty()) post_tensors(current, index);
  }
  // Announced shapes: post the tensors of messages whose header arrived, in action order (in-order transports
  // pair each channel's messages in posting order). On a GPU reading a header waits for the device, so there the
  // tensors are posted by the RECV itself.
  if (!transport_.device().is_cpu()) return;
  for (auto& [index, r] : posted_) {
    if (r.tensors_posted) continue;
    if (!r.header_work->is_completed()) break;
    post_tensors(current, index);
  }
}

void Messenger::retire_completed_sends() {
  while (!sends_.empty() && sends_.front().completed()) sends_.pop_front();
}

void Messenger::finish_step() {
  activity_.note(RankStatus::State::kWaiting, nullptr, -1, "its last sends of the step to be received");
  for (auto& s : sends_) {
    for (auto& w : s.works) w->wait(options_.timeout);
  }
  sends_.clear();
}

}  // namespace twobp::detail
