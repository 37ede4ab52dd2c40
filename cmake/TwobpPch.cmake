# Build time: precompiled headers and, further below, unity builds.
#
# Precompiled headers (TWOBP_PCH, ON by default). LibTorch's headers are most of our compile time: <ATen/ATen.h>
# takes ~9 s to parse, <torch/torch.h> ~13 s, in every translation unit. A precompiled header pays the parse once
# per *family* of targets built with the same flags (GCC refuses a PCH made with other -f/-O options;
# -Winvalid-pch says so), and every translation unit of the family loads it. Loading is not free (~2.5 s for the
# library's, ~6 s for <torch/torch.h>'s, mostly template instantiation GCC defers to the end of each translation
# unit), so each family precompiles what its sources include, and sources that include no LibTorch header (the
# schedules: data, no tensors) skip it. Families: the libraries (twobp_add_library), the tests and their probes
# (one host target, twobp_test_pch), each program. docs/TESTING.md ("Build time") has the measurements.
#
# With ccache, setup.sh sets CCACHE_SLOPPINESS=pch_defines,time_macros (ccache's condition for caching both the PCH
# and the objects built with it). A PCH can hide a missing #include in our own sources: the install tests compile
# the public headers without one (install_umbrella_header, install_consumer); TWOBP_PCH=OFF builds as before.
option(TWOBP_PCH "Precompile LibTorch's and the other libraries' headers once per family of targets" ON)

# What the library's sources include (none of them includes <torch/torch.h>).
set(TWOBP_PCH_LIBRARY_HEADERS <ATen/ATen.h> <torch/nn/module.h> <torch/csrc/autograd/function.h>
    <torch/csrc/autograd/variable.h> <fmt/format.h> <fmt/ranges.h> <nlohmann/json.hpp> <algorithm> <functional>
    <map> <memory> <mutex> <string> <vector>)
# What the tests and the programs include.
set(TWOBP_PCH_PROGRAM_HEADERS <torch/torch.h> <fmt/format.h> <fmt/ranges.h> <nlohmann/json.hpp> <algorithm>
    <functional> <map> <memory> <string> <vector>)

# twobp_precompile(<target> <header>...): <target> precompiles these headers.
function(twobp_precompile target)
  if(NOT TWOBP_PCH)
    return()
  endif()
  target_precompile_headers(${target} PRIVATE ${ARGN})
  target_compile_options(${target} PRIVATE -Winvalid-pch)
endfunction()

# twobp_reuse_pch(<target> <host>): <target> uses <host>'s precompiled header. Only for targets built with the
# host's flags (same compile options and definitions that reach the headers; include directories may differ).
function(twobp_reuse_pch target host)
  if(NOT TWOBP_PCH)
    return()
  endif()
  target_precompile_headers(${target} REUSE_FROM ${host})
  target_compile_options(${target} PRIVATE -Winvalid-pch)
endfunction()

# twobp_skip_pch(<source>...): these sources compile without the precompiled header (they include no LibTorch
# header, so loading it would only cost time).
function(twobp_skip_pch)
  set_source_files_properties(${ARGN} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
endfunction()

# Unity groups (TWOBP_UNITY, ON by default): the library's sources compile one folder of src/ per translation unit
# (with the precompiled header: loaded once per folder, it costs less than what it saves; twobp_skip_pch matters
# only file by file), so that what every source instantiates at the end of its translation unit (LibTorch's, fmt's
# and the standard library's templates) is compiled once per folder instead of once per file. docs/TESTING.md
# ("Build time") has the measurements. A change to one source recompiles its folder; -DTWOBP_UNITY=OFF compiles
# file by file. A name that two sources of a folder define at namespace scope
# (even in an anonymous namespace) fails to compile in a group: give one of them another name.
option(TWOBP_UNITY "Compile the library's sources one folder of src/ per translation unit" ON)

# twobp_unity_program(<target> <batch size>): a program's sources compile in batches of that many, in the order
# add_executable lists them (list the sources that include <torch/torch.h> so that each batch has its share), and
# without a precompiled header: with two or three translation units per program, precompiling costs more than
# it saves. Returns false (in <target>_UNITY) when TWOBP_UNITY is OFF, so that the caller precompiles instead.
function(twobp_unity_program target batch_size)
  set(${target}_UNITY ${TWOBP_UNITY} PARENT_SCOPE)
  if(TWOBP_UNITY)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE BATCH
                                               UNITY_BUILD_BATCH_SIZE ${batch_size})
    target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Wno-subobject-linkage>)
  endif()
endfunction()

# twobp_unity(<target> <source root>): <target>'s sources under <source root>, grouped by folder.
function(twobp_unity target root)
  if(NOT TWOBP_UNITY)
    return()
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE GROUP)
  # GCC warns about a type of an anonymous namespace used by a struct "in a header" -- every source is one once
  # included into a group's file.
  target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Wno-subobject-linkage>)
  get_target_property(sources ${target} SOURCES)
  foreach(source IN LISTS sources)
    file(RELATIVE_PATH relative ${root} ${source})
    get_filename_component(group ${relative} DIRECTORY)
    if(group STREQUAL "")
      set(group top)
    endif()
    string(REPLACE "/" "_" group ${group})
    set_source_files_properties(${source} PROPERTIES UNITY_GROUP ${group})
  endforeach()
endfunction()
