#pragma once
// Private: the unit-slot form of the controllable-memory V schedules (v-half, v-min; Qi et al., arXiv 2405.15362)
// and the paper's "squeeze" of their warm-up and cool-down, for generators.cpp.

#include <array>
#include <utility>
#include <vector>

namespace twobp::detail {

/// The four F/I kinds of a V rank, rank r holding stages r (chunk 0) and 2p - 1 - r (chunk 1), in the paper's
/// block order: F of chunk 0, F of chunk 1, I of chunk 1, I of chunk 0.
enum VKind : int { kVF0 = 0, kVF1 = 1, kVI1 = 2, kVI0 = 3 };

/// One rank's F/I actions in unit time slots (F = I = W = 1, no latency): per kind, the slot of each micro-batch's
/// action, micro-batch 0 first. A rank runs one action per slot; slots no F/I uses are free for W's.
using VRankSlots = std::array<std::vector<long>, 4>;

/// The paper's building blocks (its authors' stable patterns): on rank r, micro-batch j's F0, F1, I1 and I0 at
/// fixed slots plus 6 j (six slots per micro-batch and rank: 2 F, 2 I, 2 W). The slots fix how long a micro-batch's
/// activations wait for their I, and so the memory:
/// - v-half: F0 at 2r, F1 at 3p - r - 2, I1 at 3p + d + 2r - 1, I0 at 6p + d - r - 2 (d = 3 for even p, else 0):
///   (p + 2) // 2 micro-batches of a 1F1B stage (p + 2 chunks) per rank at most, about half of 1F1B's p;
/// - v-min: F0 at r, F1 at 2p - r - 1, I1 at 2p + d + r, I0 at 4p + d - r - 1 (d = 2 when 3 divides p, else 0):
///   (p + 4) // 3 micro-batches of a 1F1B stage at most, about a third of 1F1B's, with a larger bubble.
std::vector<VRankSlots> v_half_blocks(int p, int m);
std::vector<VRankSlots> v_min_blocks(int p, int m);

/// The W's of one rank as the V schedules place them: each free slot before the rank's last F/I (and, with
/// `trailing`, each slot after it until none is left) runs the oldest pending W, chunk 1's before chunk 0's.
/// Returns (slot, chunk) in slot order; without `trailing` the W's left over are not returned.
std::vector<std::pair<long, int>> v_weight_slots(const VRankSlots& slots, bool trailing);

/// The paper's squeeze, which its memory-controllable schedules are defined with: in the warm-up (before rank 0's
/// first I of chunk 0) and the cool-down (after rank 0's last F), each action in turn, in slot order, moves to the
/// earliest free slot after its inputs' slots where moving it raises neither of its rank's two memory peaks above
/// the largest such peak of any rank before the squeeze: live activations (F to I) and the activations and W
/// state together (F to W). First with the W's placed by v_weight_slots (trailing) as actions, then, W's taken out,
/// the cool-down again with W's in the free slots; the steady state is kept as the blocks lay it out. The result
/// is again a valid slot plan (every action after its inputs, one action per slot and rank), so each rank's
/// actions in slot order, W's as v_weight_slots places them, form a deadlock-free order.
std::vector<VRankSlots> squeeze_v(std::vector<VRankSlots> slots);

}  // namespace twobp::detail
