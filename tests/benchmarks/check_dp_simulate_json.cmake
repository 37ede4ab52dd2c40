# cmake -DJSON=file -DDP=n [-DMIN_RESULTS=1] -P check_dp_simulate_json.cmake
# Checks the data-parallel output of `twobp_bench simulate --dp n --dp-overlap both`: every result has "dp" = n,
# "dp_overlap" (a boolean), "dp_reduce_ms" > 0 and "dp_exposed_ms" >= 0, and for every 2bp result with overlap on
# the result of the same schedule and v with overlap off exists and exposes at least as much all-reduce time
# (dp_exposed_ms(on) <= dp_exposed_ms(off)) and takes at least as long (sim_step_ms). Fails naming every violation.
set(FIELDS dp_reduce_ms sim_step_ms)
include(${CMAKE_CURRENT_LIST_DIR}/read_dp_results.cmake)
foreach(i RANGE ${_last})
  if(NOT "${_dp_reduce_ms_${i}}" MATCHES "^[0-9.eE+-]+$" OR NOT _dp_reduce_ms_${i} GREATER 0)
    list(APPEND _problems "${_name_${i}}: dp_reduce_ms is '${_dp_reduce_ms_${i}}', expected > 0")
  endif()
endforeach()

# Overlap on vs off, 2bp rows.
set(_compared 0)
foreach(i RANGE ${_last})
  if(NOT _mode_${i} STREQUAL "2bp" OR NOT _dp_overlap_${i} STREQUAL "ON")
    continue()
  endif()
  set(_partner "")
  foreach(k RANGE ${_last})
    if(_schedule_${k} STREQUAL _schedule_${i} AND _mode_${k} STREQUAL "2bp" AND _v_${k} STREQUAL _v_${i}
       AND _dp_overlap_${k} STREQUAL "OFF")
      set(_partner ${k})
    endif()
  endforeach()
  set(_name "${_schedule_${i}} 2bp v=${_v_${i}}")
  if(_partner STREQUAL "")
    list(APPEND _problems "${_name}: no result with dp_overlap false to compare with")
    continue()
  endif()
  if(_dp_exposed_ms_${i} GREATER _dp_exposed_ms_${_partner})
    list(APPEND _problems
         "${_name}: dp_exposed_ms with overlap (${_dp_exposed_ms_${i}}) exceeds without (${_dp_exposed_ms_${_partner}})")
  endif()
  if(_sim_step_ms_${i} GREATER _sim_step_ms_${_partner})
    list(APPEND _problems
         "${_name}: sim_step_ms with overlap (${_sim_step_ms_${i}}) exceeds without (${_sim_step_ms_${_partner}})")
  endif()
  math(EXPR _compared "${_compared} + 1")
endforeach()
if(_compared EQUAL 0)
  list(APPEND _problems "no 2bp result with dp_overlap true")
endif()

if(_problems)
  list(JOIN _problems "\n  " _text)
  message(FATAL_ERROR "${JSON}: invalid data-parallel simulate output:\n  ${_text}")
endif()
message(STATUS "${JSON}: ${_n} results; overlap on vs off compared for ${_compared} 2bp results")
