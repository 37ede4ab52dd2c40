# cmake -P script behind the install_* tests (tests/install/CMakeLists.txt). STEP selects the test:
#   install   install BUILD_DIR into WORK_DIR/prefix, check its CMake files for absolute paths, move it to
#             WORK_DIR/moved (so that nothing can still point at the place it was installed to)
#   consumer  configure, build and run tests/install/consumer against WORK_DIR/moved
#   example   configure, build and run examples/llama_pipeline against WORK_DIR/moved
#   minimal   configure, build and run examples/minimal against WORK_DIR/moved, linked against twobp::core alone;
#             its loss must fall
#   umbrella  include/twobp/core.h and kit.h include every public header of their tier (cmake/TwobpTiers.cmake) and
#             none of the other's; twobp.h includes both
#   docs      the documentation's snippets (PYTHON runs tests/scripts/doc_blocks.py) as tests/docs/project against
#             WORK_DIR/moved, configured by the README's configure line itself; built, and docs_fragments run
set(prefix ${WORK_DIR}/prefix)
set(moved ${WORK_DIR}/moved)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

# configure_and_build(<source dir> <build dir> <extra cmake arguments>...): a project of its own that knows
# twobp only through the moved prefix and LibTorch's CMake prefix, as the README tells users to do.
function(configure_and_build source build)
  if(NOT EXISTS ${moved}/lib/cmake/twobp/twobpConfig.cmake)
    message(FATAL_ERROR "no installed package at ${moved}: run the install_package test first")
  endif()
  set(extra "")
  if(CXX_LAUNCHER)
    list(APPEND extra -DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER})
  endif()
  if(GENERATOR)
    list(APPEND extra -G ${GENERATOR})
  endif()
  if(THIRD_PARTY)
    list(APPEND extra -DTWOBP_THIRD_PARTY_INCLUDE_DIR=${THIRD_PARTY})
  endif()
  file(REMOVE ${build}/CMakeCache.txt)  # a fresh configure each time; objects stay (and ccache has them)
  run(${CMAKE_COMMAND} -S ${source} -B ${build} -DCMAKE_BUILD_TYPE=Release ${extra}
      "-DCMAKE_PREFIX_PATH=${moved}\;${TORCH_PREFIX}" ${ARGN})
  set(configure_output "${run_output}" PARENT_SCOPE)
  if(NOT CONFIGURE_ONLY)
    run(${CMAKE_COMMAND} --build ${build})
  endif()
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE ${prefix} ${moved})
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
  # A package that can move names its dependencies by imported target (torch, MPI::MPI_CXX, NCCL::NCCL, ...),
  # never by path: no LibTorch, CUDA, NCCL or MPI location, no path into this build, the sources or the prefix.
  # (Comment lines are skipped: the generated files mention paths only in comments.)
  file(GLOB cmake_files ${prefix}/lib/cmake/twobp/twobp*.cmake)
  list(LENGTH cmake_files n)
  if(n LESS 3)
    message(FATAL_ERROR "expected twobpConfig.cmake, twobpConfigVersion.cmake, twobpTargets.cmake; got: ${cmake_files}")
  endif()
  foreach(file IN LISTS cmake_files)
    file(STRINGS ${file} lines)
    foreach(line IN LISTS lines)
      if(line MATCHES "^ *#")
        continue()
      endif()
      foreach(bad site-packages /cuda libnccl libc10 libtorch /usr/ ${TORCH_PREFIX} ${BUILD_DIR} ${PROJECT_DIR}
                  ${WORK_DIR})
        string(FIND "${line}" "${bad}" at)
        if(at GREATER -1)
          message(FATAL_ERROR "${file} names '${bad}', the package cannot move:\n  ${line}")
        endif()
      endforeach()
      if(line MATCHES "(^|[\";])/[A-Za-z]")
        message(FATAL_ERROR "${file} holds an absolute path, the package cannot move:\n  ${line}")
      endif()
      # Nor does it hand consumers compile definitions they did not ask for (FMT_HEADER_ONLY is twobp's own).
      if(line MATCHES "INTERFACE_COMPILE_DEFINITIONS|INTERFACE_COMPILE_OPTIONS")
        message(FATAL_ERROR "${file} gives consumers compile definitions or options:\n  ${line}")
      endif()
    endforeach()
  endforeach()
  file(RENAME ${prefix} ${moved})
  message(STATUS "installed, checked ${n} CMake files, moved to ${moved}")

elseif(STEP STREQUAL "consumer")
  # CMAKE_DISABLE_FIND_PACKAGE_*: a consumer of twobp::twobp alone must not need MPI or NCCL, and components
  # whose dependencies are missing are only reported not found when optional ...
  set(hide -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_NCCL=ON)
  configure_and_build(${PROJECT_DIR}/tests/install/consumer ${WORK_DIR}/consumer ${hide})
  if(NOT configure_output MATCHES "twobp components: MPI FALSE, NCCL FALSE")
    message(FATAL_ERROR "MPI and NCCL hidden, yet reported found:\n${configure_output}")
  endif()
  run(${WORK_DIR}/consumer/consumer)
  if(NOT run_output MATCHES "consumer: ok")
    message(FATAL_ERROR "unexpected output: ${run_output}")
  endif()
  # ... and fail find_package, saying why, when required.
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${PROJECT_DIR}/tests/install/consumer -B ${WORK_DIR}/consumer_required
                          "-DCMAKE_PREFIX_PATH=${moved};${TORCH_PREFIX}" ${hide} -DCONSUMER_REQUIRE=MPI
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " err_text "${err}")  # CMake wraps its messages
  if(rc EQUAL 0 OR NOT err_text MATCHES "component MPI: MPI for C\\+\\+ was not found")
    message(FATAL_ERROR "find_package(twobp COMPONENTS MPI) with MPI hidden: expected a failure naming the "
                        "component, got (${rc}):\n${out}\n${err}")
  endif()

elseif(STEP STREQUAL "example")
  configure_and_build(${PROJECT_DIR}/examples/llama_pipeline ${WORK_DIR}/example)
  run(${WORK_DIR}/example/examples/llama_pipeline --model tiny --ranks 2 --microbatches 2 --micro-batch-size 1
      --seq-len 16 --steps 2 --json ${WORK_DIR}/example/losses.json)
  file(READ ${WORK_DIR}/example/losses.json json)
  string(JSON steps LENGTH "${json}" steps)
  if(NOT steps EQUAL 2)
    message(FATAL_ERROR "expected 2 losses in ${WORK_DIR}/example/losses.json, got:\n${json}")
  endif()

elseif(STEP STREQUAL "minimal")
  # The program users copy from, with the core package only (no MPI, no NCCL): it must build as it stands and
  # learn (its last loss under a quarter of its first; it falls from ~0.57 to ~0.01 in 60 steps).
  configure_and_build(${PROJECT_DIR}/examples/minimal ${WORK_DIR}/minimal
                      -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_NCCL=ON)
  # It links twobp::core alone: the core's archive must link without the kit's (no kit archive on the link line).
  file(GLOB_RECURSE link_rules ${WORK_DIR}/minimal/build.ninja ${WORK_DIR}/minimal/link.txt)
  set(core_linked FALSE)
  foreach(rules IN LISTS link_rules)
    file(READ ${rules} text)
    if(text MATCHES "twobp_kit")
      message(FATAL_ERROR "examples/minimal links the kit (${rules}); it must need twobp::core alone")
    endif()
    if(text MATCHES "libtwobp_core")
      set(core_linked TRUE)
    endif()
  endforeach()
  if(NOT core_linked)
    message(FATAL_ERROR "no link rule of examples/minimal names libtwobp_core (looked in: ${link_rules})")
  endif()
  run(${WORK_DIR}/minimal/examples/minimal)
  string(REGEX MATCHALL "loss [0-9.]+" losses "${run_output}")
  list(LENGTH losses n)
  if(n LESS 2)
    message(FATAL_ERROR "expected progress lines 'step N loss X', got:\n${run_output}")
  endif()
  list(GET losses 0 first)
  list(GET losses -1 last)
  string(REPLACE "loss " "" first "${first}")
  string(REPLACE "loss " "" last "${last}")
  # math() knows integers only: both losses are printed with 4 decimals, so compare them in units of 1e-4.
  string(REPLACE "." "" first_units "${first}")
  string(REPLACE "." "" last_units "${last}")
  math(EXPR last_times_4 "${last_units} * 4")
  if(NOT last_times_4 LESS first_units)
    message(FATAL_ERROR "the minimal example's loss did not fall to under a quarter: ${first} -> ${last}\n"
                        "${run_output}")
  endif()
  message(STATUS "minimal: loss ${first} -> ${last}")

elseif(STEP STREQUAL "umbrella")
  cmake_policy(SET CMP0057 NEW)  # if(IN_LIST) in twobp_tier
  include(${PROJECT_DIR}/cmake/TwobpTiers.cmake)
  foreach(tier core kit union)
    set(name ${tier})
    if(tier STREQUAL "union")
      set(name twobp)
    endif()
    file(READ ${PROJECT_DIR}/include/twobp/${name}.h ${tier}_text)
  endforeach()
  set(wrong "")
  foreach(expected "union:twobp/core.h" "union:twobp/kit.h" "kit:twobp/core.h")
    string(REPLACE ":" ";" pair "${expected}")
    list(GET pair 0 tier)
    list(GET pair 1 header)
    string(FIND "${${tier}_text}" "#include \"${header}\"" at)
    if(at EQUAL -1)
      list(APPEND wrong "the umbrella of '${tier}' does not include ${header}")
    endif()
  endforeach()
  file(GLOB_RECURSE headers RELATIVE ${PROJECT_DIR}/include ${PROJECT_DIR}/include/twobp/*.h)
  list(REMOVE_ITEM headers twobp/twobp.h twobp/core.h twobp/kit.h)
  foreach(header IN LISTS headers twobp/config.h)
    string(REGEX REPLACE "^twobp/" "" relative ${header})
    twobp_tier(${relative} tier)
    set(other core)
    if(tier STREQUAL "core")
      set(other kit)
    endif()
    string(FIND "${${tier}_text}" "#include \"${header}\"" at)
    if(at EQUAL -1)
      list(APPEND wrong "include/twobp/${tier}.h does not include ${header}")
    endif()
    string(FIND "${${other}_text}" "#include \"${header}\"" at)
    if(at GREATER -1)
      list(APPEND wrong "include/twobp/${other}.h includes ${header}, a ${tier} header")
    endif()
  endforeach()
  if(wrong)
    list(JOIN wrong "\n  " wrong)
    message(FATAL_ERROR "umbrella headers (tiers: cmake/TwobpTiers.cmake):\n  ${wrong}")
  endif()

elseif(STEP STREQUAL "docs")
  # The blocks as doc_blocks.py extracts them, next to the project's CMakeLists.txt; a fresh tree, build
  # directory included, each time (ccache keeps the objects).
  set(source ${WORK_DIR}/docs)
  file(REMOVE_RECURSE ${source})
  file(COPY ${PROJECT_DIR}/tests/docs/project/CMakeLists.txt DESTINATION ${source})
  run(${PYTHON} ${PROJECT_DIR}/tests/scripts/doc_blocks.py extract ${PROJECT_DIR} ${source})
  if(NOT EXISTS ${moved}/lib/cmake/twobp/twobpConfig.cmake)
    message(FATAL_ERROR "no installed package at ${moved}: run the install_package test first")
  endif()
  # Each shell block marked snippet runs as written, in the project's directory, with its placeholders filled
  # in: the prefix, and the Python whose torch this build used. The generator and compiler launcher of this
  # build come through CMake's environment variables, so that the line itself stays the README's.
  set(ENV{CMAKE_GENERATOR} "${GENERATOR}")
  if(CXX_LAUNCHER)
    set(ENV{CMAKE_CXX_COMPILER_LAUNCHER} "${CXX_LAUNCHER}")
  endif()
  file(GLOB commands ${source}/*.sh)
  if(NOT commands)
    message(FATAL_ERROR "no shell snippet (the README's configure line, <!-- snippet: readme_configure -->)")
  endif()
  foreach(command_file IN LISTS commands)
    file(READ ${command_file} command)
    string(REPLACE "<twobp prefix>" "${moved}" command "${command}")
    string(REPLACE "<twobp checkout>/.venv/bin/python" "${PYTHON}" command "${command}")
    if(command MATCHES "<[a-z][a-z ]*>")
      message(FATAL_ERROR "${command_file}: a placeholder this test cannot fill (${CMAKE_MATCH_0}):\n${command}")
    endif()
    file(WRITE ${command_file} "${command}")
    run(sh -e ${command_file} WORKING_DIRECTORY ${source})
  endforeach()
  run(${CMAKE_COMMAND} --build ${source}/build)
  # The programs that are whole jobs run: the run_ranks block trains a step on 2 rank threads.
  run(${source}/build/docs_fragments)
  message(STATUS "docs: the documentation's snippets built against ${moved}")

else()
  message(FATAL_ERROR "unknown STEP '${STEP}'")
endif()
