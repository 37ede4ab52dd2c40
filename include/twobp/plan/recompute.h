#pragma once
// Recomputation by pipeline rank: the set of ranks whose stages recompute their activations, as the planners,
// AutoSchedule, the memory estimates and the command lines (--recompute-on) name it, and the order in which the
// planners hand it out. (Declared in twobp/schedule/schedule.h before 0.2.0: the core runs whatever stages a
// program marks; choosing them is the kit's.)

#include <string>
#include <string_view>
#include <vector>

namespace twobp {

/// Recomputation by rank, the one form the planners, AutoSchedule, the memory estimate and the command lines share:
/// a set of pipeline ranks whose stages all recompute their activations, ascending without repeats.
/// `--recompute [--recompute-ranks N | --recompute-on RANKS]`: none without `recompute`; else the ranks `on` lists
/// ("0-1,3", parse_ranks) when it is not empty; else the first `first` ranks (0: every rank), at most num_ranks.
/// Throws UsageError for a list parse_ranks refuses (its message, after "--recompute-on: "), or for both `first` > 0
/// and a list.
std::vector<int> recomputing_ranks(bool recompute, int first, std::string_view on, int num_ranks);

/// Whether `rank` is in `ranks` (ascending, as recomputing_ranks returns them).
bool has_rank(const std::vector<int>& ranks, int rank);

/// "0-2,5" for {0, 1, 2, 5} and "" for none: ascending ranks, runs of consecutive ranks as ranges.
std::string format_ranks(const std::vector<int>& ranks);

/// The ranks `text` names ("3", "0,3", "0-2,5"; any order, repeats allowed), ascending without repeats. Throws
/// UsageError naming the text when it is empty, malformed, or names a rank outside 0 .. num_ranks - 1.
std::vector<int> parse_ranks(std::string_view text, int num_ranks);

/// The order in which ranks take up recomputation when fewer than all of them do (the planners' candidates
/// recompute on the first 1 .. num_ranks ranks of it): by each rank's peak memory without recomputation, highest
/// first, ties by rank -- so that the ranks over any memory limit come first and recomputing on the first j of
/// them is the least recomputation that can fit it (a rank's peak depends only on its own actions' order, not on
/// what other ranks recompute). 1F1B-like orders hold the most on their first ranks; a GPipe-like order with a
/// large vocabulary on the last. `peaks` per rank; empty for `num_ranks` ranks without a memory model: by rank.
std::vector<int> recompute_order(const std::vector<double>& peaks, int num_ranks);

/// The first `count` ranks of `order` (recompute_order), ascending.
std::vector<int> first_ranks_of(const std::vector<int>& order, int count);

}  // namespace twobp
