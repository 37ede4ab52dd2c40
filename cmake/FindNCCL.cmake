# FindNCCL: NCCL's header and library as the imported target NCCL::NCCL.
#
# Shipped with twobp's package (next to twobpConfig.cmake), so that the exported targets name NCCL::NCCL instead
# of a path that is only valid on the machine that built twobp.
#
# Search order: NCCL_ROOT (variable or environment, CMake's <Package>_ROOT), then the NCCL that LibTorch itself
# loads -- the PyPI nvidia-nccl wheel next to torch, <site-packages>/nvidia/nccl, found from TORCH_INSTALL_PREFIX
# (set by find_package(Torch)) -- then the CUDA toolkit, then the system. Prefer torch's: two different NCCLs in
# one process clash. The wheel ships only libnccl.so.2 (no libnccl.so symlink), hence both names.
#
# Result variables: NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION. Target: NCCL::NCCL.

set(_nccl_hints)
if(TORCH_INSTALL_PREFIX)
  list(APPEND _nccl_hints "${TORCH_INSTALL_PREFIX}/../nvidia/nccl")
endif()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}")
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
             HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${part} +([0-9]+)" _nccl_match "${_nccl_version_lines}")
    set(_nccl_${part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
unset(_nccl_hints)
unset(_nccl_version_lines)
unset(_nccl_match)
