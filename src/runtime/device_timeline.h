#pragma once
// Device timing of a step: on a GPU the host only enqueues work, so host times would describe the enqueueing, not
// the pipeline. Events on this rank's current stream bracket every action; they are read once, after the step.
// Private to the runtime (the Executor's run()).

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "twobp/trace/trace.h"

namespace twobp::detail {

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

}  // namespace twobp::detail
