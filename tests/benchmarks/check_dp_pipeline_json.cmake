# cmake -DJSON=file -DDP=n [-DMIN_RESULTS=1] -P check_dp_pipeline_json.cmake
# Checks the data-parallel fields of `twobp_bench pipeline --dp n` (n > 1): every result has "dp" = n, "dp_overlap"
# (a boolean), "dp_exposed_ms" >= 0, "dp_reduce_bytes" > 0 and "dp_buckets" (during_backward, after_backward or
# after_step, agreeing with dp_overlap), every schedule x mode x v ran with overlap on and with overlap off, and
# every standard one also with its buckets started after the last B (after_backward; 2BP never). Timings are not
# compared (the machine is noisy). Fails naming every violation.
set(FIELDS dp_reduce_bytes dp_buckets)
include(${CMAKE_CURRENT_LIST_DIR}/read_dp_results.cmake)

set(_configs)  # schedule|mode|v of every result
foreach(i RANGE ${_last})
  if(NOT "${_dp_reduce_bytes_${i}}" MATCHES "^[0-9.eE+-]+$" OR NOT _dp_reduce_bytes_${i} GREATER 0)
    list(APPEND _problems "${_name_${i}}: dp_reduce_bytes is '${_dp_reduce_bytes_${i}}', expected > 0")
  endif()
  set(_b "${_dp_buckets_${i}}")
  if(NOT _b MATCHES "^(during_backward|after_backward|after_step)$")
    list(APPEND _problems "${_name_${i}}: dp_buckets is '${_b}', expected during_backward, after_backward or after_step")
  elseif((_b STREQUAL "after_step" AND _dp_overlap_${i} STREQUAL "ON") OR
         (NOT _b STREQUAL "after_step" AND _dp_overlap_${i} STREQUAL "OFF"))
    list(APPEND _problems "${_name_${i}}: dp_buckets '${_b}' disagrees with dp_overlap ${_dp_overlap_${i}}")
  endif()
  if(_b STREQUAL "after_backward")
    set(_after_b_${_schedule_${i}}_${_mode_${i}}_${_v_${i}} 1)
  endif()
  list(APPEND _configs "${_schedule_${i}} ${_mode_${i}} v=${_v_${i}}")
  set(_overlap_${_schedule_${i}}_${_mode_${i}}_${_v_${i}}_${_dp_overlap_${i}} 1)
endforeach()

list(REMOVE_DUPLICATES _configs)
list(LENGTH _configs _n_configs)
foreach(config IN LISTS _configs)
  string(REPLACE " " ";" _parts "${config}")
  list(GET _parts 0 _schedule)
  list(GET _parts 1 _mode)
  string(REPLACE "v=" "" _v "${config}")
  string(REGEX REPLACE ".* " "" _v "${_v}")
  foreach(setting ON OFF)
    if(NOT DEFINED _overlap_${_schedule}_${_mode}_${_v}_${setting})
      list(APPEND _problems "${config}: no result with dp_overlap ${setting}")
    endif()
  endforeach()
  if(_mode STREQUAL "standard" AND NOT DEFINED _after_b_${_schedule}_${_mode}_${_v})
    list(APPEND _problems "${config}: no result with dp_buckets after_backward")
  elseif(_mode STREQUAL "2bp" AND DEFINED _after_b_${_schedule}_${_mode}_${_v})
    list(APPEND _problems "${config}: a 2bp result with dp_buckets after_backward (no such setting for 2BP)")
  endif()
endforeach()

if(_problems)
  list(JOIN _problems "\n  " _text)
  message(FATAL_ERROR "${JSON}: invalid data-parallel pipeline output:\n  ${_text}")
endif()
message(STATUS "${JSON}: ${_n} results, ${_n_configs} schedule x mode configurations, each with overlap on and off (standard: also after B)")
