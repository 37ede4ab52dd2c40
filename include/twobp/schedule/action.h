#pragma once
// The vocabulary of pipeline schedules. A schedule is data: per rank, an ordered list of Actions. Generators
// produce it, validate()/simulate() reason about it, and the executor interprets it; nothing else decides order.

#include <cstdint>
#include <string>
#include <vector>

namespace twobp {

/// What one action does. Compute actions run on the rank that owns `stage`; communication actions move the
/// tensors of `stage` to or from the rank owning the neighbouring stage.
enum class ActionType : std::uint8_t {
  kForward,         ///< F: forward of `stage` for one micro-batch.
  kBackwardInput,   ///< I: 2BP stage 1, gradient w.r.t. the stage input only (sent upstream at once).
  kBackwardWeight,  ///< W: 2BP stage 2, weight gradients for one or several micro-batches (batched GEMMs).
  kBackward,        ///< B: fused backward (ordinary backprop: I and W in one pass).
  kSendForward,     ///< SEND_F: send the output of `stage` to the rank owning stage + 1.
  kRecvForward,     ///< RECV_F: receive the input of `stage` from the rank owning stage - 1.
  kSendBackward,    ///< SEND_B: send the input gradient of `stage` to the rank owning stage - 1.
  kRecvBackward,    ///< RECV_B: receive the output gradient of `stage` from the rank owning stage + 1.
};
/// The number of action types (tables indexed by static_cast<int>(ActionType)).
inline constexpr int kNumActionTypes = 8;

/// One step of one rank's program. `stage` is the global stage index in [0, num_stages); a rank owning several
/// chunks (interleaved, V schedules) owns several stages. `micro_batches` holds exactly one entry, except for
/// kBackwardWeight, which may batch several micro-batches into one W.
struct Action {
  ActionType type = ActionType::kForward;
  int stage = 0;
  std::vector<int> micro_batches;
  /// An overlapped F&B pair (DualPipe's overlapped_forward_backward, PyTorch's OVERLAP_F_B): set on an F whose
  /// next action in the rank's list is the B (or I) of another stage, which the two may then run at the same time
  /// -- one micro-batch's compute hiding another's communication, or two streams sharing a GPU. Each part keeps its
  /// own meaning (dependencies()); the pair only adds that both parts' inputs are there before the F starts and
  /// their outputs are sent after the B ends (for_overlapped_pairs() places them so; validate() checks both). The
  /// Executor runs the parts one after the other unless ExecutorOptions::overlap_forward_backward takes them.
  bool overlapped_with_next = false;

  friend bool operator==(const Action& a, const Action& b) {
    return a.type == b.type && a.stage == b.stage && a.micro_batches == b.micro_batches &&
           a.overlapped_with_next == b.overlapped_with_next;
  }
  friend bool operator!=(const Action& a, const Action& b) { return !(a == b); }
};

/// Short mnemonic used by the text form and the grid: "F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B".
const char* to_string(ActionType type);

/// True for F, I, W and B.
inline bool is_compute(ActionType t) {
  return t == ActionType::kForward || t == ActionType::kBackwardInput || t == ActionType::kBackwardWeight ||
         t == ActionType::kBackward;
}

/// True for W and B: the actions that produce parameter gradients (where a stage's gradients become final).
inline bool makes_weight_grads(ActionType t) { return t == ActionType::kBackwardWeight || t == ActionType::kBackward; }

/// True for SEND_F and SEND_B.
inline bool is_send(ActionType t) { return t == ActionType::kSendForward || t == ActionType::kSendBackward; }

/// True for RECV_F and RECV_B.
inline bool is_receive(ActionType t) { return t == ActionType::kRecvForward || t == ActionType::kRecvBackward; }

/// Human-readable form of one action, e.g. "F stage 2 micro-batch 3" or "W stage 1 micro-batches 0,1,2"; used in
/// error messages.
std::string describe(const Action& action);

}  // namespace twobp
