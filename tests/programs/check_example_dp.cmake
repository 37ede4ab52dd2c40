# The example's data parallelism through MPI processes: `mpiexec -n 4 llama_pipeline --dp 2 --microbatches 4`
# must give the per-step losses of `mpiexec -n 2 llama_pipeline --dp 1 --microbatches 8` (the same global batch of
# 16 sequences in the same order) within 1e-4, float32; so must `--dp 2 --zero 1` (AdamW state sharded over the
# replicas), whose ranks must hold at most 60 % of the unsharded run's optimizer state, and `--dp 2 --zero 2`
# (gradients sharded too, reduce-scattered as W finishes each bucket).
# Inputs: MPIEXEC, MPIEXEC_FLAGS (space-separated), EXAMPLE, WORK (a directory).
separate_arguments(_flags UNIX_COMMAND "${MPIEXEC_FLAGS}")
set(_common --model tiny --micro-batch-size 2 --seq-len 32 --lr 1e-2 --timeout 60 --seed 7 --steps 10 --schedule 1f1b)
file(MAKE_DIRECTORY "${WORK}")
foreach(run "4;2;4;dp2;0" "2;1;8;dp1;0" "4;2;4;zero;1" "4;2;4;zero2;2")
  list(GET run 0 np)
  list(GET run 1 dp)
  list(GET run 2 m)
  list(GET run 3 name)
  list(GET run 4 zero)
  execute_process(COMMAND ${MPIEXEC} -n ${np} ${_flags} ${EXAMPLE} ${_common} --dp ${dp} --microbatches ${m}
                          --zero ${zero} --json ${WORK}/${name}.json
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out TIMEOUT 600)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "mpiexec -n ${np} --dp ${dp} failed (${_rc}):\n${_out}")
  endif()
  file(READ ${WORK}/${name}.json _doc_${name})
endforeach()
string(JSON _n LENGTH "${_doc_dp1}" steps)
string(JSON _n2 LENGTH "${_doc_dp2}" steps)
if(NOT _n EQUAL 10 OR NOT _n2 EQUAL 10)
  message(FATAL_ERROR "expected 10 steps in both runs, got ${_n} and ${_n2}")
endif()
string(JSON _dp GET "${_doc_dp2}" dp)
if(NOT _dp EQUAL 2)
  message(FATAL_ERROR "the --dp 2 run reports dp ${_dp}")
endif()
math(EXPR _last "${_n} - 1")
foreach(other dp2 zero zero2)
  foreach(i RANGE ${_last})
    string(JSON a GET "${_doc_dp1}" steps ${i} loss)
    string(JSON b GET "${_doc_${other}}" steps ${i} loss)
    # |a - b| <= 1e-4 * max(1, |a|) (awk: CMake has no floating point).
    execute_process(COMMAND awk "BEGIN { d = ${a} - ${b}; if (d < 0) d = -d; s = ${a} < 0 ? -${a} : ${a}; if (s < 1) s = 1; exit (d <= 1e-4 * s) ? 0 : 1 }"
                    RESULT_VARIABLE _far)
    if(NOT _far EQUAL 0)
      message(FATAL_ERROR "step ${i}: loss ${a} with dp 1 but ${b} with ${other}")
    endif()
  endforeach()
endforeach()
string(JSON _full GET "${_doc_dp2}" optimizer_state_bytes)
string(JSON _sharded GET "${_doc_zero}" optimizer_state_bytes)
execute_process(COMMAND awk "BEGIN { exit (${_full} > 0 && ${_sharded} <= 0.6 * ${_full}) ? 0 : 1 }" RESULT_VARIABLE _big)
if(NOT _big EQUAL 0)
  message(FATAL_ERROR "--zero 1 ranks hold up to ${_sharded} bytes of optimizer state, --zero 0 ranks ${_full}")
endif()
message(STATUS "dp 2 x pp 2, with --zero 0, 1 and 2, matches dp 1 x pp 2 on 10 steps; state ${_sharded} of ${_full} bytes")
