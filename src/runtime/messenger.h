#pragma once
// The messages of one rank's action list: what its SEND actions send and its RECV actions receive, one step at a
// time. Private to the runtime; the Executor owns one and hands it the tensors a SEND takes from its mailbox.
//
// Each tensor of a boundary's NamedTensors travels as one message. With fixed specs (ExecutorOptions::
// activation_spec / boundary_spec) receivers allocate from the spec and post ahead, and every sent tensor is checked
// against it (UsageError naming both stages, before it is sent); without, the sender first sends a shape header
// (runtime/boundary.h; MessagePart::header(), channels 2 and 3) from which the receiver allocates. A gradient
// message says which gradients are undefined and carries only the others.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "runtime/boundary.h"
#include "runtime/rank_activity.h"
#include "twobp/runtime/executor.h"
#include "twobp/schedule/messages.h"
#include "twobp/schedule/schedule.h"
#include "twobp/tensors.h"
#include "twobp/transport/transport.h"

namespace twobp::detail {

class Messenger {
 public:
  /// `schedule`, `transport`, `options` and `activity` must outlive the messenger.
  Messenger(const Schedule& schedule, int rank, Transport& transport, const ExecutorOptions& options,
            RankActivity& activity);

  /// Starts a step whose message tags are offset by `tag_offset` (run number * message_tag_span).
  void start_step(std::int64_t tag_offset);
  /// Before the action at `current` (an index into the rank's actions): keeps up to prefetch_receives receives
  /// posted, and posts every RECV up to `up_to_inclusive` -- on a transport whose receives hold the device, never
  /// ahead of a SEND of this rank that precedes them and has not run (see prefetch() in messenger.cpp).
  void prefetch(std::size_t current, std::size_t up_to_inclusive);
  /// Sends `tensors`, the item of SEND action `a`; they are kept alive until the transport is done with them.
  void send(const Action& a, NamedTensors tensors);
  /// Waits for the RECV action at `index` (posted by prefetch()) and returns its tensors; an activation that
  /// carries a gradient arrives as a leaf that requires grad.
  NamedTensors receive(std::size_t index);
  /// Forgets the sends that completed, so that their buffers do not pile up over a long step.
  void retire_completed_sends();
  /// The step's end: waits until the transport is done with every send.
  void finish_step();
  /// Forgets the step's messages (after a failure, once the transport was aborted).
  void clear();

 private:
  struct PostedRecv {
    at::Tensor header;  // announced shapes: the header, received first
    std::unique_ptr<Work> header_work;
    bool tensors_posted = false;
    std::vector<AnnouncedTensor> layout;  // from the header or the spec
    std::vector<at::Tensor> buffers;      // one per layout entry (undefined when absent)
    std::vector<std::unique_ptr<Work>> works;
  };
  struct PendingSend {
    std::vector<at::Tensor> tensors;  // kept alive until the transport is done with them
    std::vector<std::unique_ptr<Work>> works;
    bool completed() const;
  };
  void post_tensors(std::size_t current, std::size_t index);
  BoundarySpec fixed_spec(int boundary) const;
  P2POptions message_options(const Action& a, MessagePart part) const;
  void check_against_spec(const Action& a, const NamedTensors& t, const std::vector<bool>& gradient,
                          const BoundarySpec& spec_all) const;

  const Schedule& schedule_;
  int rank_;
  Transport& transport_;
  const ExecutorOptions& options_;
  RankActivity& activity_;
  std::vector<std::size_t> recv_actions_;  // indices of RECV_* in this rank's action list
  // The step's state.
  std::int64_t tag_offset_ = 0;
  std::size_t next_recv_ = 0;  // into recv_actions_
  std::map<std::size_t, PostedRecv> posted_;  // by action index
  std::deque<PendingSend> sends_;
};

}  // namespace twobp::detail
