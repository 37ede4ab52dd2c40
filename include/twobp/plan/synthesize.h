#pragma once
// Moved: schedule synthesis is a cost-driven generator of the core, twobp/schedule/synthesize.h (RankCosts is in
// twobp/schedule/simulate.h). This header keeps including it, so that code written against 0.1 compiles.

#include "twobp/schedule/synthesize.h"
