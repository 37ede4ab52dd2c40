#include "twobp/runtime/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>

#include <cmath>
#include <deque>
#include <set>
#include <unordered_set>
#include <utility>

#include "util/check.h"

namespace twobp {
namespace {

using Key = std::pair<int, int>;  // (stage, micro-batch)

std::string describe_spec(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  return fmt::format("[{}] {}", fmt::join(shape, ", "), c10::toString(dtype));
}

// Clips in place to max_norm given the global norm; a no-op when already within it or when the norm is not finite.
void clip_to(const std::vector<at::Tensor>& params, double norm, double max_norm) {
  if (!(norm > max_norm) || !std::isfinite(norm)) return;
  const double scale = max_norm / (norm + 1e-6);
  c10::AutoGradMode no_grad(false);
  for (const auto& p : params) {
    if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().mul_(scale);
  }
}

double elapsed_us(Clock::time_point since) {
  return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
}

}  // namespace

// Per-step state of the executor. Everything is keyed by (stage, micro-batch) so that the executor can follow
// any valid schedule without knowing which one it is.
struct Pipeline::Impl {
  struct PostedRecv {
    at::Tensor buffer;
    std::unique_ptr<Work> work;
  };
  struct PendingSend {
    at::Tensor tensor;  // kept alive until the transport is done with it
    std::unique_ptr<Work> work;
    std::string label;
  };

  std::map<Key, at::Tensor> outputs;       // F results waiting for SEND_F or a local F of the next stage
  std::map<Key, at::Tensor> input_grads;   // I/B results waiting for SEND_B or a local I/B of the previous stage
  std::map<Key, at::Tensor> received_fwd;  // completed RECV_F, consumed by F
  std::map<Key, at::Tensor> received_bwd;  // completed RECV_B, consumed by I/B
  std::map<std::size_t, PostedRecv> posted;  // by action index
  std::deque<PendingSend> sends;
  std::vector<std::size_t> recv_actions;  // indices of RECV_* in this rank's action list
  std::size_t next_recv = 0;

  void clear() {
    outputs.clear();
    input_grads.clear();
    received_fwd.clear();
    received_bwd.clear();
    posted.clear();
    sends.clear();
    next_recv = 0;
  }
};

Pipeline::Pipeline(Schedule schedule, std::vector<PipelineChunk> chunks, std::shared_ptr<Transport> transport,
                   PipelineOptions options)
    : schedule_(std::move(schedule)),
      transport_(std::move(transport)),
      options_(std::move(options)),
      impl_(std::make_unique<Impl>()) {
  TWOBP_CHECK(transport_ != nullptr, UsageError, "Pipeline: transport is null");
  const int rank = transport_->rank();
  TWOBP_CHECK(transport_->world_size() == schedule_.num_ranks, UsageError,
              "rank {}: schedule '{}' is for {} ranks, but the transport has {}", rank, schedule_.name,
              schedule_.num_ranks, transport_->world_size());
  // Before step 1: a schedule the transport cannot pair (e.g. NCCL, which pairs in posting order per channel)
  // would deliver tensors to the wrong buffers or hang; refuse it here with the offending action marked.
  validate(schedule_, transport_->pairing());
  const std::vector<int> mine = schedule_.stages_of(rank);
  std::set<int> given;
  for (auto& chunk : chunks) {
    TWOBP_CHECK(std::find(mine.begin(), mine.end(), chunk.stage) != mine.end(), UsageError,
                "rank {}: got a chunk for stage {}, but schedule '{}' places that stage on rank {}", rank, chunk.stage,
                schedule_.name, chunk.stage >= 0 && chunk.stage < schedule_.num_stages
                                    ? schedule_.stage_to_rank[chunk.stage]
                                    : -1);
    TWOBP_CHECK(given.insert(chunk.stage).second, UsageError, "rank {}: two chunks for stage {}", rank, chunk.stage);
    StageOptions so;
    so.stage_index = chunk.stage;
    so.num_stages = schedule_.num_stages;
    so.rank = rank;
    so.batch_weight_grads = options_.batch_weight_grads;
    if (chunk.stage == schedule_.num_stages - 1) {
      TWOBP_CHECK(static_cast<bool>(options_.loss), UsageError,
                  "rank {}: stage {} is the last stage and needs PipelineOptions::loss", rank, chunk.stage);
      so.loss = options_.loss;
      so.loss_scale = 1.0 / schedule_.num_micro_batches;
    }
    stages_.emplace(chunk.stage, std::make_unique<Stage>(std::move(chunk.module), std::move(chunk.forward), so));
  }
  for (int s : mine) {
    TWOBP_CHECK(given.count(s) != 0, UsageError, "rank {}: schedule '{}' places stage {} on this rank, but no chunk "
                "was given for it", rank, schedule_.name, s);
  }
  if (schedule_.num_ranks > 1) {
    TWOBP_CHECK(static_cast<bool>(options_.activation_spec), UsageError,
                "rank {}: PipelineOptions::activation_spec is required with more than one rank", rank);
  }
  const auto& actions = schedule_.actions[rank];
  for (std::size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].type == ActionType::kRecvForward || actions[i].type == ActionType::kRecvBackward) {
      impl_->recv_actions.push_back(i);
    }
  }
}

Pipeline::~Pipeline() = default;

Stage& Pipeline::stage(int index) {
  auto it = stages_.find(index);
  TWOBP_CHECK(it != stages_.end(), UsageError, "rank {}: stage {} is not on this rank", rank(), index);
  return *it->second;
}

std::vector<int> Pipeline::stage_indices() const {
  std::vector<int> out;
  for (const auto& [s, st] : stages_) out.push_back(s);
  return out;
}

std::vector<at::Tensor> Pipeline::parameters() const {
  std::vector<at::Tensor> params;
  for (const auto& [s, st] : stages_) {
    for (auto& p : st->parameters()) params.push_back(p);
  }
  // A weight tied between two chunks of this rank (zb-v puts the first and the last stage on rank 0) is one
  // parameter: counting it twice would double it in the norm and scale it twice when clipping.
  return unique_tensors(params);
}

void Pipeline::zero_grad() {
  for (auto& p : parameters()) p.mutable_grad().reset();
}

GradientCheck Pipeline::check_gradients() {
  // [sum of squares, then one non-finite flag per stage]: one all-reduce gives every rank the same verdict.
  std::vector<double> local(schedule_.num_stages + 1, 0.0);
  // Each parameter is counted once, in the first of this rank's stages that lists it.
  std::unordered_set<const c10::TensorImpl*> counted;
  for (const auto& [index, stage_ptr] : stages_) {
    bool bad = false;
    for (const auto& p : stage_ptr->parameters()) {
      if (!p.grad().defined() || !counted.insert(p.unsafeGetTensorImpl()).second) continue;
      // A sparse gradient may hold one index several times: coalesce (sum duplicates) before squaring.
      const at::Tensor g = p.grad().is_sparse() ? p.grad().coalesce() : p.grad();
      const double sq = g.to(at::kDouble).pow(2).sum().item<double>();
      if (!std::isfinite(sq)) bad = true;
      local[0] += sq;
    }
    if (index == schedule_.num_stages - 1) {
      for (double l : last_losses_) bad = bad || !std::isfinite(l);
    }
    local[index + 1] = bad ? 1.0 : 0.0;
  }
  at::Tensor total = at::tensor(local, at::TensorOptions().dtype(at::kDouble)).to(transport_->device());
  transport_->all_reduce_sum(total, options_.timeout);
  total = total.cpu();
  GradientCheck check;
  check.norm = std::sqrt(total[0].item<double>());
  for (int s = 0; s < schedule_.num_stages; ++s) {
    if (total[s + 1].item<double>() != 0.0) check.non_finite_stages.push_back(s);
  }
  return check;
}

bool Pipeline::ready_for_optimizer(int step, NonFinitePolicy policy, double max_norm) {
  const GradientCheck check = check_gradients();
  if (!check.finite()) {
    TWOBP_CHECK(policy != NonFinitePolicy::kStop, NumericalError,
                "rank {}: step {}: non-finite loss or gradient in stage(s) {}; no optimizer step was taken", rank(),
                step, fmt::join(check.non_finite_stages, ", "));
    zero_grad();
    ++skipped_steps_;
    return false;
  }
  if (max_norm > 0.0) clip_to(parameters(), check.norm, max_norm);
  return true;
}

double Pipeline::clip_grad_norm(double max_norm) {
  const double norm = global_grad_norm();
  clip_to(parameters(), norm, max_norm);
  return norm;
}

StepResult Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const int me = rank();
  const int m = schedule_.num_micro_batches;
  const int last = schedule_.num_stages - 1;
  const auto& actions = schedule_.actions[me];
  Impl& st = *impl_;
  st.clear();
  StepResult result;
  const Clock::time_point start = Clock::now();

  auto owner = [&](int s) { return schedule_.stage_to_rank[s]; };
  auto where = [&](const Action& a) { return fmt::format("rank {}: {}", me, describe(a)); };

  auto split_batch = [&](const at::Tensor& batch, int stage_index, const char* what) {
    TWOBP_CHECK(batch.defined(), UsageError, "rank {}: owns stage {} and needs the {} of the batch, got none", me,
                stage_index, what);
    TWOBP_CHECK(batch.dim() > 0 && batch.size(0) % m == 0, UsageError,
                "rank {}: {} with {} samples cannot be split into {} micro-batches of equal size", me, what,
                batch.dim() > 0 ? batch.size(0) : 0, m);
    return batch.split(batch.size(0) / m);
  };
  std::vector<at::Tensor> input_mbs, target_mbs;

  // The label of a message names the action on *this* side; both sides compute the same tag.
  auto p2p = [&](const Action& a) {
    P2POptions o;
    o.peer = peer_rank(schedule_, a);
    o.tag = message_tag(schedule_, a);
    o.label = describe(a);
    o.channel = message_channel(a);
    o.timeout = options_.timeout;
    return o;
  };
  auto boundary_spec = [&](int boundary_stage) { return options_.activation_spec(boundary_stage); };
  // Checks a tensor about to cross a stage boundary against the boundary's declared spec, naming the producing
  // and the receiving stage: the receiver's buffer was allocated from the spec, so a mismatch caught here is a
  // mismatch that would otherwise corrupt or hang the receiver.
  auto check_spec = [&](const at::Tensor& t, int boundary_stage, const Action& a, int receiver, const char* what) {
    const TensorSpec spec = boundary_spec(boundary_stage);
    TWOBP_CHECK(t.sizes().vec() == spec.shape && t.scalar_type() == spec.dtype, UsageError,
                "{}: stage {} (rank {}) produced {} {} for micro-batch {}, but stage {} (rank {}) expects {}",
                where(a), a.stage, me, what, describe_spec(t.sizes().vec(), t.scalar_type()), a.micro_batches[0],
                receiver, owner(receiver), describe_spec(spec.shape, spec.dtype));
  };
  auto post_recv = [&](std::size_t index) {
    const Action& a = actions[index];
    const int boundary = a.type == ActionType::kRecvForward ? a.stage - 1 : a.stage;
    const TensorSpec spec = boundary_spec(boundary);
    Impl::PostedRecv r;
    r.buffer = at::empty(spec.shape, at::TensorOptions().dtype(spec.dtype).device(transport_->device()));
    r.work = transport_->irecv(r.buffer, p2p(a));
    st.posted.emplace(index, std::move(r));
  };
  auto prefetch = [&](std::size_t upto_inclusive) {
    // Keep up to prefetch_receives receives in flight, and always post the one about to be waited on.
    std::size_t in_flight = st.posted.size();
    while (st.next_recv < st.recv_actions.size() &&
           (st.recv_actions[st.next_recv] <= upto_inclusive ||
            static_cast<int>(in_flight) < options_.prefetch_receives)) {
      post_recv(st.recv_actions[st.next_recv++]);
      ++in_flight;
    }
  };
  auto take = [&](std::map<Key, at::Tensor>& from, Key key, const Action& a, const char* what) {
    auto it = from.find(key);
    TWOBP_CHECK(it != from.end(), ScheduleError, "{}: the {} for it is not available (schedule order bug)",
                where(a), what);
    at::Tensor t = std::move(it->second);
    from.erase(it);
    return t;
  };
  // On a GPU the host only enqueues work, so host times would describe the enqueueing, not the pipeline. There,
  // timing events on this rank's current stream bracket every action; they are read once, after the step.
  const c10::Device device = transport_->device();
  const bool device_timing = !device.is_cpu();
  auto device_event = [&]() {
    auto e = std::make_unique<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    e->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
    return e;
  };
  std::unique_ptr<c10::Event> step_event;
  std::vector<std::pair<std::unique_ptr<c10::Event>, std::unique_ptr<c10::Event>>> action_events;
  if (device_timing) step_event = device_event();
  std::unique_ptr<c10::Event> begin_event;
  auto record = [&](const Action& a, Clock::time_point t0) {
    result.trace.events.push_back(TraceEvent{me, a, std::chrono::duration<double, std::micro>(t0 - start).count(),
                                             elapsed_us(start)});
    if (device_timing) action_events.emplace_back(std::move(begin_event), device_event());
  };

  try {
    if (stages_.count(0)) input_mbs = split_batch(inputs, 0, "inputs");
    if (stages_.count(last)) target_mbs = split_batch(targets, last, "targets");
    // Losses stay on the device until the step ends: one copy to the host per step instead of a device
    // synchronisation per micro-batch (which would also distort the trace on GPUs).
    std::vector<at::Tensor> losses(stages_.count(last) ? m : 0);
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      prefetch(a.type == ActionType::kRecvForward || a.type == ActionType::kRecvBackward ? i : 0);
      const Clock::time_point t0 = Clock::now();
      if (device_timing) begin_event = device_event();
      const int mb = a.micro_batches.empty() ? -1 : a.micro_batches[0];
      switch (a.type) {
        case ActionType::kForward: {
          at::Tensor input;
          if (a.stage == 0) {
            input = input_mbs.at(mb);
          } else if (owner(a.stage - 1) == me) {
            input = take(st.outputs, {a.stage - 1, mb}, a, "output of the previous stage");
          } else {
            input = take(st.received_fwd, {a.stage, mb}, a, "received activation");
          }
          at::Tensor out = stage(a.stage).forward(mb, input, a.stage == last ? target_mbs.at(mb) : at::Tensor());
          if (a.stage == last) {
            losses[mb] = out.detach().reshape({1});
          } else {
            if (owner(a.stage + 1) != me) check_spec(out, a.stage, a, a.stage + 1, "activations");
            st.outputs[{a.stage, mb}] = out;
          }
          break;
        }
        case ActionType::kBackwardInput:
        case ActionType::kBackward: {
          at::Tensor grad_output;
          if (a.stage != last) {
            grad_output = owner(a.stage + 1) == me
                              ? take(st.input_grads, {a.stage + 1, mb}, a, "input gradient of the next stage")
                              : take(st.received_bwd, {a.stage, mb}, a, "received gradient");
          }
          Stage& s = stage(a.stage);
          at::Tensor grad_input = a.type == ActionType::kBackward ? s.backward(mb, grad_output)
                                                                   : s.backward_input(mb, grad_output);
          if (a.stage > 0) {
            if (owner(a.stage - 1) != me) check_spec(grad_input, a.stage - 1, a, a.stage - 1, "gradients");
            st.input_grads[{a.stage, mb}] = grad_input;
          }
          break;
        }
        case ActionType::kBackwardWeight:
          stage(a.stage).backward_weight(a.micro_batches);
          break;
        case ActionType::kSendForward:
        case ActionType::kSendBackward: {
          const bool fwd = a.type == ActionType::kSendForward;
          at::Tensor t = take(fwd ? st.outputs : st.input_grads, {a.stage, mb}, a,
                              fwd ? "activation to send" : "gradient to send");
          t = t.contiguous();
          auto options = p2p(a);
          auto work = transport_->isend(t, options);
          st.sends.push_back({std::move(t), std::move(work), options.label});
          break;
        }
        case ActionType::kRecvForward:
        case ActionType::kRecvBackward: {
          auto it = st.posted.find(i);
          TWOBP_CHECK(it != st.posted.end(), ScheduleError, "{}: receive was not posted", where(a));
          it->second.work->wait(options_.timeout);
          at::Tensor buffer = std::move(it->second.buffer);
          st.posted.erase(it);
          (a.type == ActionType::kRecvForward ? st.received_fwd : st.received_bwd)[{a.stage, mb}] = buffer;
          break;
        }
      }
      record(a, t0);
      // Completed sends are retired as we go so their buffers do not pile up over a long step.
      while (!st.sends.empty() && st.sends.front().work->is_completed()) st.sends.pop_front();
    }
    for (auto& s : st.sends) s.work->wait(options_.timeout);
    st.sends.clear();
    if (!losses.empty()) {
      // SYNC POINT: the step's only device-to-host copy on the last stage.
      const at::Tensor host = at::cat(losses).to(at::kDouble).cpu();
      result.losses.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
    }
    for (const auto& [index, stage_ptr] : stages_) {
      TWOBP_CHECK(stage_ptr->live_micro_batches() == 0, ScheduleError,
                  "rank {}: stage {} ended the step with {} micro-batches whose backward did not finish", me, index,
                  stage_ptr->live_micro_batches());
    }
  } catch (const std::exception& e) {
    for (auto& [index, stage_ptr] : stages_) stage_ptr->reset();
    st.clear();
    // Tell every peer now: they would otherwise wait for their timeout on messages this rank will never send.
    try {
      transport_->abort(fmt::format("rank {} failed: {}", me, e.what()));
    } catch (...) {
    }
    throw;
  }
  result.trace.step_us = elapsed_us(start);
  if (device_timing && !action_events.empty()) {
    // SYNC POINT: once per step, after everything was enqueued, to turn the events into the device timeline.
    action_events.back().second->synchronize();
    for (std::size_t k = 0; k < action_events.size(); ++k) {
      result.trace.events[k].start_us = 1000.0 * step_event->elapsedTime(*action_events[k].first);
      result.trace.events[k].end_us = 1000.0 * step_event->elapsedTime(*action_events[k].second);
    }
    result.trace.step_us = std::max(result.trace.step_us, result.trace.events.back().end_us);
  }
  last_losses_ = result.losses;
  return result;
}

}  // namespace twobp
