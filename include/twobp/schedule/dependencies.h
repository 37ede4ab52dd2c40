#pragma once
// What each action needs and produces: the one table of action meaning. validate() checks a schedule's order
// against it, the dry run (simulate(), render_grid()) waits on it, and the executor moves tensors by it, so a new
// action kind or a change of meaning is made here once.

#include <cstdint>
#include <string>
#include <vector>

#include "twobp/schedule/action.h"

namespace twobp {

struct Schedule;

/// What passes from one action to another within a rank (a message carries an item to another rank).
enum class Item : std::uint8_t {
  kActivation,     ///< the output of stage s's F for one micro-batch (the input of stage s + 1)
  kInputGrad,      ///< the gradient w.r.t. stage s's input, from its I or B (the output gradient of stage s - 1)
  kSavedGraph,     ///< what stage s's F keeps for its backward (the autograd graph and saved activations)
  kPendingWeight,  ///< the weight-gradient work stage s's I leaves for a W
};

const char* to_string(Item item);

/// One item of one stage and micro-batch.
struct ItemRef {
  Item item = Item::kActivation;
  int stage = 0;
  int micro_batch = 0;
  friend bool operator==(const ItemRef& a, const ItemRef& b) {
    return a.item == b.item && a.stage == b.stage && a.micro_batch == b.micro_batch;
  }
};

/// The items an action consumes (all must be available on its rank before it runs) and the ones it makes
/// available on its rank.
struct ActionDependencies {
  std::vector<ItemRef> needs;
  std::vector<ItemRef> produces;
};

/// The table, for a pipeline of `num_stages` stages (s = action.stage, mb = each of its micro-batches):
///   F(s)      needs Activation(s-1) (s > 0)                     produces SavedGraph(s), Activation(s) (s < last)
///   I(s)      needs SavedGraph(s), InputGrad(s+1) (s < last)    produces PendingWeight(s), InputGrad(s) (s > 0)
///   B(s)      needs SavedGraph(s), InputGrad(s+1) (s < last)    produces InputGrad(s) (s > 0)
///   W(s)      needs PendingWeight(s) of each of its micro-batches
///   SEND_F(s) needs Activation(s)          RECV_F(s) produces Activation(s-1)   (the message of boundary s-1|s)
///   SEND_B(s) needs InputGrad(s)           RECV_B(s) produces InputGrad(s+1)    (the message of boundary s|s+1)
/// A SEND is matched by the RECV of the same item on the peer (peer_rank, message_tag, message_channel).
ActionDependencies dependencies(const Action& action, int num_stages);

/// The action that makes `item` available on `rank`: the producing compute action when `rank` owns the item's
/// stage, otherwise the receive that brings it there (RECV_F of stage + 1 for an activation, RECV_B of stage - 1
/// for an input gradient). A backward is the I or B the rank's list holds for that stage and micro-batch (split
/// schedules may fuse some), else named after the schedule's mode.
Action local_producer(const ItemRef& item, int rank, const Schedule& schedule);

/// "the activation of stage 1 micro-batch 2"; used in error messages.
std::string describe(const ItemRef& item);

}  // namespace twobp
