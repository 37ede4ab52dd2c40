#include "twobp/plan/stage_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include <time.h>

#include "runtime/master_weights.h"
#include "twobp/error.h"
#include "twobp/metrics/memory.h"
#include "twobp/metrics/op_count.h"

namespace twobp {

TimerClock parse_clock(const std::string& name) {
  if (name == "wall") return TimerClock::kWall;
  if (name == "cpu") return TimerClock::kProcessCpu;
  throw UsageError("unknown clock '" + name + "' (wall or cpu)");
}

double now_ms(TimerClock clock) {
  timespec ts{};
  clock_gettime(clock == TimerClock::kWall ? CLOCK_MONOTONIC : CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

StageTimer::StageTimer(std::shared_ptr<torch::nn::Module> module, StageForward forward, at::Tensor input,
                       StageTimerOptions options)
    : module_(std::move(module)), input_(std::move(input)), options_(options) {
  module_->to(input_.device(), at::kFloat);
  if (options_.mixed_precision) {
    if (input_.scalar_type() != at::kBFloat16 && input_.scalar_type() != at::kHalf) {
      throw UsageError("StageTimer: mixed precision computes in the input's dtype, which is " +
                       std::string(c10::toString(input_.scalar_type())) + ": give a bfloat16 or float16 input");
    }
    // As the pipeline does: float32 masters, the module in the compute dtype, each W or B's gradient into the
    // masters'.
    masters_ = std::make_unique<detail::MasterWeights>(std::map<int, std::shared_ptr<torch::nn::Module>>{{1, module_}},
                                                       input_.scalar_type(), /*rank=*/0);
  } else {
    module_->to(input_.scalar_type());
  }
  for (const at::Tensor& p : unique_tensors(module_->parameters())) {
    if (p.requires_grad()) gradient_holders_.push_back(masters_ ? masters_->master_of(p) : p);
  }
  measurable_ = options_.record_memory && memory::measurable(input_.device());
  StageOptions stage_options;
  stage_options.stage_index = 1;
  stage_options.num_stages = 3;
  stage_ = std::make_unique<Stage>(module_, std::move(forward), stage_options);
  const at::Tensor out = stage_->forward(0, input_);
  stage_->reset();
  grad_output_ = at::randn_like(out);
}

StageTimer::~StageTimer() = default;

void StageTimer::synchronize() const {
  if (input_.is_cpu()) return;
  c10::impl::getDeviceGuardImpl(input_.device().type())->synchronizeDevice(input_.device().index());
}

// WHY the peaks: on a device with statistics each phase also records the allocator's peak above what was
// allocated when it began; resetting the peak per phase loses the run's, which is kept apart.
template <typename Fn>
PhaseTime StageTimer::timed(Fn&& fn) {
  std::int64_t base = 0;
  if (measurable_) {
    const memory::Allocated before = memory::allocated(input_.device());
    base = before.current;
    peak_ = std::max(peak_, before.peak);
    memory::reset_peak(input_.device());
  }
  PhaseTime t;
  const double start = now_ms(options_.clock);
  fn();
  t.host_ms = now_ms(options_.clock) - start;
  synchronize();
  t.synced_ms = now_ms(options_.clock) - start;
  if (measurable_) {
    const std::int64_t peak = memory::allocated(input_.device()).peak;
    peak_ = std::max(peak_, peak);
    peak_above_start_ = std::max(peak_above_start_, peak - base);
  }
  return t;
}

// Gradients as before the first micro-batch of a step (none) or a later one (existing: zeros where there were
// none), on the masters under mixed precision (the compute parameters' .grad stays none, as in the pipeline).
void StageTimer::prepare_gradients(bool existing) {
  module_->zero_grad(/*set_to_none=*/true);
  for (const at::Tensor& holder : gradient_holders_) {
    at::Tensor& g = const_cast<at::Tensor&>(holder).mutable_grad();
    if (!existing) {
      g.reset();
    } else if (!g.defined()) {
      g = at::zeros_like(holder);
    }
  }
  // WHY: the zeros are device work the next timed phase must not wait for.
  if (existing) synchronize();
}

StageTimer::Split StageTimer::split(bool existing_gradients) {
  prepare_gradients(existing_gradients);
  Split s;
  s.forward = timed([&] { stage_->forward(0, input_); });
  s.input = timed([&] { stage_->backward_input(0, grad_output_); });
  s.weight = timed([&] { stage_->backward_weight({0}); });
  return s;
}

StageTimer::Fused StageTimer::fused(bool existing_gradients) {
  prepare_gradients(existing_gradients);
  Fused f;
  f.forward = timed([&] { stage_->forward(0, input_); });
  f.backward = timed([&] { stage_->backward(0, grad_output_); });
  return f;
}

std::vector<StageTimer::PhaseOps> StageTimer::count_ops(bool by_name) {
  metrics::AtenOpCounterOptions counter_options;
  counter_options.by_name = by_name;
  counter_options.thread_cpu_time = options_.clock == TimerClock::kProcessCpu && input_.is_cpu();
  metrics::AtenOpCounter counter(counter_options);
  std::vector<PhaseOps> out;
  auto phase = [&](const char* name, const std::function<void()>& fn) {
    counter.take();
    const double start = counter.now_us();
    fn();
    const double elapsed_us = counter.now_us() - start;
    metrics::AtenOpCounter::Counts c = counter.take();
    synchronize();
    out.push_back({name, c.ops, counter.outside_us(elapsed_us, c), std::move(c.by_name)});
  };
  prepare_gradients(/*existing=*/true);
  phase("F", [&] { stage_->forward(0, input_); });
  phase("I", [&] { stage_->backward_input(0, grad_output_); });
  phase("W", [&] { stage_->backward_weight({0}); });
  prepare_gradients(/*existing=*/true);
  phase("F", [&] { stage_->forward(0, input_); });
  phase("B", [&] { stage_->backward(0, grad_output_); });
  return out;
}

StageTimer::DeviceTimes StageTimer::device_timed() {
  const c10::Device device = input_.device();
  if (device.is_cpu()) throw UsageError("StageTimer::device_timed: the input is on the CPU (device events need a GPU)");
  std::vector<std::unique_ptr<c10::Event>> marks;
  auto mark = [&] {
    marks.push_back(std::make_unique<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT));
    marks.back()->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  };
  prepare_gradients(/*existing=*/false);
  mark();
  stage_->forward(0, input_);
  mark();
  stage_->backward_input(0, grad_output_);
  mark();
  stage_->backward_weight({0});
  mark();
  prepare_gradients(/*existing=*/false);  // sets .grad to none: no device work, nothing to wait for
  stage_->forward(0, input_);
  mark();
  stage_->backward(0, grad_output_);
  mark();
  // SYNC POINT: the events are read once everything was enqueued.
  marks.back()->synchronize();
  auto span = [&](std::size_t k) { return marks[k]->elapsedTime(*marks[k + 1]); };
  return {span(0), span(1), span(2), span(4)};
}

PhaseTime StageTimer::weight_batch(int micro_batches, bool batched) {
  if (micro_batches < 1) throw UsageError("StageTimer::weight_batch: micro_batches must be >= 1");
  prepare_gradients(/*existing=*/false);
  std::vector<int> mbs(static_cast<std::size_t>(micro_batches));
  std::iota(mbs.begin(), mbs.end(), 0);
  for (int mb : mbs) stage_->forward(mb, input_);
  for (int mb : mbs) stage_->backward_input(mb, grad_output_);
  return timed([&] {
    if (batched) {
      stage_->backward_weight(mbs);
    } else {
      for (int mb : mbs) stage_->backward_weight({mb});
    }
  });
}

std::map<std::string, at::Tensor> StageTimer::values() {
  prepare_gradients(/*existing=*/false);
  std::map<std::string, at::Tensor> v;
  v["output"] = stage_->forward(0, input_).detach().to(at::kFloat);
  const at::Tensor grad_input = stage_->backward_input(0, grad_output_);
  if (grad_input.defined()) v["input gradient"] = grad_input.to(at::kFloat);
  stage_->backward_weight({0});
  for (const auto& item : module_->named_parameters()) {
    const at::Tensor holder = masters_ ? masters_->master_of(item.value()) : item.value();
    if (holder.grad().defined()) v[item.key() + ".grad"] = holder.grad().to(at::kFloat);
  }
  prepare_gradients(/*existing=*/false);
  return v;
}

std::int64_t StageTimer::parameter_count() const {
  std::int64_t n = 0;
  for (const at::Tensor& p : unique_tensors(module_->parameters())) n += p.numel();
  return n;
}

ValueComparison compare_values(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  ValueComparison out;
  for (const auto& [name, value] : b) {
    const auto it = a.find(name);
    if (it == a.end() || it->second.sizes() != value.sizes()) {
      out.not_compared.push_back(name);
      continue;
    }
    const double scale = value.norm().item<double>();
    const double diff = (it->second - value).norm().item<double>() / (scale > 0 ? scale : 1.0);
    ++out.compared;
    // A NaN counts as the largest, and stays so (every comparison with it is false).
    if (!std::isnan(out.max_relative_difference) && !(diff <= out.max_relative_difference)) {
      out.max_relative_difference = diff;
      out.worst = name;
    }
  }
  return out;
}

}  // namespace twobp
