#pragma once
// A group split from a transport that names its ranks as the job does: by world rank in errors and hang reports,
// reporting through the parent's status board (ParallelGroups' groups, the tied parameters' groups).

#include <memory>
#include <vector>

#include "twobp/transport/transport.h"

namespace twobp::detail {

/// `group` (split from `parent`) with members[r] = the rank in `parent` of the group's rank r. Null stays null.
std::unique_ptr<Transport> world_named_group(std::unique_ptr<Transport> group, const Transport& parent,
                                             const std::vector<int>& members);

}  // namespace twobp::detail
