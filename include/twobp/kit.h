#pragma once
// Umbrella header of the kit, twobp::kit: what helps around the core (twobp/core.h, included here) -- planners,
// models, data, checkpoints, charts, step logs and program helpers (Job, InterruptGuard, LR schedules). Link
// twobp::kit (it links twobp::core) or twobp::twobp. docs/ARCHITECTURE.md draws the line between the two.
//
// Every public header of the kit is listed here (install_umbrella_header checks it against include/twobp/ and
// cmake/TwobpTiers.cmake).

#include "twobp/core.h"

#include "twobp/checkpoint.h"
#include "twobp/checkpoint/safetensors.h"
#include "twobp/data.h"

#include "twobp/metrics/step_log.h"
#include "twobp/models/bert.h"
#include "twobp/models/hf_llama.h"
#include "twobp/models/llama.h"
#include "twobp/models/llama_rank.h"
#include "twobp/models/resnet.h"
#include "twobp/plan/choose.h"
#include "twobp/plan/cost_source.h"
#include "twobp/plan/llama.h"
#include "twobp/plan/llama_memory.h"
#include "twobp/plan/measure.h"
#include "twobp/plan/placement.h"
#include "twobp/plan/recompute.h"
#include "twobp/plan/record.h"
#include "twobp/plan/stage_timer.h"
#include "twobp/plan/step_meter.h"
#include "twobp/plan/synthesize.h"
#include "twobp/plan/trials.h"
#include "twobp/runtime/interrupt.h"
#include "twobp/runtime/job.h"
#include "twobp/runtime/lr_schedule.h"
#include "twobp/trace/chart.h"
