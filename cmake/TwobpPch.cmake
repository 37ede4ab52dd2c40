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
