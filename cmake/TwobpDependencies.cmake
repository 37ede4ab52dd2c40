# Finds the dependencies of twobp. Everything optional degrades to a smaller build, never to a failed one:
# without MPI the library still runs several stages in one process (LocalTransport); without CUDA/NCCL the
# GPU transport is left out.

# LibTorch: find_package(Torch), or its CPU libraries alone where the wheel is a CUDA build and no CUDA toolkit
# exists (cmake/TwobpTorch.cmake says when and why).
include(TwobpTorch)
twobp_find_torch()
get_filename_component(TWOBP_TORCH_ROOT "${TORCH_INSTALL_PREFIX}" ABSOLUTE)

# fmt: LibTorch ships fmt's headers; we use them header-only so that exactly one fmt version is in every
# binary (a second, Debian-built libfmt would differ from the headers torch's include directory puts first).
find_path(TWOBP_FMT_INCLUDE_DIR fmt/format.h HINTS "${TWOBP_TORCH_ROOT}/include" NO_DEFAULT_PATH)
if(NOT TWOBP_FMT_INCLUDE_DIR)
  find_path(TWOBP_FMT_INCLUDE_DIR fmt/format.h REQUIRED)
endif()
# twobp_fmt: FMT_HEADER_ONLY for the library's own sources and the project's programs (tests, benchmark), never
# exported: twobp's public headers do not use fmt, so a consumer gets no compile definition it did not ask for.
# (LibTorch's include directory, which holds these headers, is already on every include path via torch.)
add_library(twobp_fmt INTERFACE)
target_compile_definitions(twobp_fmt INTERFACE FMT_HEADER_ONLY=1)
if(NOT TWOBP_FMT_INCLUDE_DIR STREQUAL "${TWOBP_TORCH_ROOT}/include")
  target_include_directories(twobp_fmt SYSTEM INTERFACE ${TWOBP_FMT_INCLUDE_DIR})
endif()

# CLI11 and nlohmann/json are header-only; Debian packages them (libcli11-dev, nlohmann-json3-dev).
# TWOBP_THIRD_PARTY_INCLUDE_DIR lets machines without the packages (the GPU image) point at carried headers.
set(TWOBP_THIRD_PARTY_INCLUDE_DIR "" CACHE PATH "Extra include directory holding CLI/ and nlohmann/ headers")
find_path(TWOBP_CLI11_INCLUDE_DIR CLI/CLI.hpp HINTS ${TWOBP_THIRD_PARTY_INCLUDE_DIR})
find_path(TWOBP_JSON_INCLUDE_DIR nlohmann/json.hpp HINTS ${TWOBP_THIRD_PARTY_INCLUDE_DIR})
if(NOT TWOBP_JSON_INCLUDE_DIR)
  message(FATAL_ERROR "nlohmann/json.hpp not found: apt-get install nlohmann-json3-dev, or set TWOBP_THIRD_PARTY_INCLUDE_DIR")
endif()

# MPI
set(TWOBP_HAVE_MPI OFF)
if(NOT TWOBP_WITH_MPI STREQUAL "OFF")
  if(TWOBP_WITH_MPI STREQUAL "ON")
    find_package(MPI REQUIRED COMPONENTS CXX)
  else()
    find_package(MPI QUIET COMPONENTS CXX)
  endif()
  if(MPI_CXX_FOUND)
    set(TWOBP_HAVE_MPI ON)
  endif()
endif()

# NCCL: only meaningful when LibTorch was built with CUDA (torch's config then found the CUDA toolkit).
# cmake/FindNCCL.cmake prefers the NCCL that LibTorch itself loads (the pip nvidia-nccl wheel): two NCCLs in one
# process clash. The same module is installed with the package, so consumers find NCCL::NCCL the same way.
set(TWOBP_HAVE_NCCL OFF)
if(NOT TWOBP_WITH_NCCL STREQUAL "OFF")
  if(TARGET c10_cuda)
    find_package(CUDAToolkit QUIET)
    if(CUDAToolkit_FOUND)
      find_package(NCCL QUIET)
    endif()
  endif()
  if(TARGET c10_cuda AND CUDAToolkit_FOUND AND NCCL_FOUND)
    set(TWOBP_HAVE_NCCL ON)
  elseif(TWOBP_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "TWOBP_WITH_NCCL=ON but LibTorch has no CUDA, or the CUDA toolkit or NCCL was not found")
  endif()
endif()

# The optional components of the installed package (twobpConfig.cmake): one library each.
set(TWOBP_BUILT_COMPONENTS "")
if(TWOBP_HAVE_MPI)
  list(APPEND TWOBP_BUILT_COMPONENTS MPI)
endif()
if(TWOBP_HAVE_NCCL)
  list(APPEND TWOBP_BUILT_COMPONENTS NCCL)
endif()

message(STATUS "twobp: torch ${Torch_VERSION} (${TWOBP_TORCH_IMPORT}), MPI ${TWOBP_HAVE_MPI}, NCCL ${TWOBP_HAVE_NCCL}, fmt ${TWOBP_FMT_INCLUDE_DIR}")
