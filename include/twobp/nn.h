#pragma once
// Umbrella header of the 2BP fast-path layers.
#include "twobp/nn/functional.h"
#include "twobp/nn/modules.h"
