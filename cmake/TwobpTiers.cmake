# The library's two tiers (docs/ARCHITECTURE.md), written once: src/CMakeLists.txt builds twobp::core and twobp::kit
# from it, and the tier_wall test (tests/install/check_wall.cmake) checks that no core file includes a kit header.
#   core  what a program links to run a pipeline: autograd, nn, stage, tensors, schedules (synthesizer included),
#         runtime, transports, trace, metrics, precision, files
#   kit   what helps around it: planners, models, data, checkpoints, charts, step logs, program helpers
# A path of the library, relative to src/ or to include/twobp/, is in the kit when its first folder is one of
# TWOBP_KIT_ROOMS (so is a top-level header named like one: checkpoint.h, data.h), or when it is one of
# TWOBP_KIT_FILES (without its extension); twobp.h is the union of both; everything else is the core.
# A new file lands in the core unless it is listed here: add a program need to the kit (STYLE.md, "Two tiers").
set(TWOBP_KIT_ROOMS plan models data checkpoint)
set(TWOBP_KIT_FILES kit trace/chart metrics/step_log runtime/job runtime/interrupt runtime/lr_schedule)

# twobp_tier(<path> <out>): "core", "kit" or "union" (twobp.h) for <path>, relative to src/ or include/twobp/.
function(twobp_tier path out)
  string(REGEX REPLACE "\\.[^./]*$" "" stem "${path}")
  string(REGEX REPLACE "/.*" "" room "${stem}")
  if(stem STREQUAL "twobp")
    set(${out} union PARENT_SCOPE)
  elseif(stem IN_LIST TWOBP_KIT_FILES OR room IN_LIST TWOBP_KIT_ROOMS)
    set(${out} kit PARENT_SCOPE)
  else()
    set(${out} core PARENT_SCOPE)
  endif()
endfunction()
