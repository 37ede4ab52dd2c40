# twobp_find_torch(): makes LibTorch available as the imported target `torch`, for twobp's own build and for
# consumers of the installed package (twobpConfig.cmake includes this file).
#
# LibTorch is the PyPI `torch` wheel. Its Linux x86_64 build is a CUDA build, and LibTorch's own CMake config
# (find_package(Torch)) then insists on a CUDA toolkit: it enables the CUDA language and stops without nvcc. A CPU
# machine has no toolkit and needs none to run LibTorch on the CPU, so:
#
#   TWOBP_TORCH_CPU_ONLY=AUTO (default)  find_package(Torch) when LibTorch is a CPU build or a CUDA toolkit is
#                                        found; otherwise the CPU-only import below
#   TWOBP_TORCH_CPU_ONLY=ON              always the CPU-only import (no torch_cuda, no NCCL transport)
#   TWOBP_TORCH_CPU_ONLY=OFF             always find_package(Torch) (fails without a toolkit for a CUDA wheel)
#
# The CPU-only import links libtorch_cpu and libc10 of the wheel, with the compile definitions and include
# directories LibTorch's config gives them. libtorch_cpu of a CUDA wheel needs libcudart and libcupti at load time
# (not a GPU): scripts/setup.sh installs them from PyPI (the wheels nvidia-cuda-runtime and nvidia-cuda-cupti,
# about 10 MB), and they are found under site-packages/nvidia/*/lib next to the torch package. Everything that is
# CUDA in twobp (the NCCL transport) needs the target c10_cuda, which this import does not define.
#
# Where LibTorch is: Torch_DIR or CMAKE_PREFIX_PATH when given, else the `torch` package of Python3 (found without
# importing it: importing torch loads the CUDA libraries, which the CPU-only install does not have).
set(TWOBP_TORCH_CPU_ONLY AUTO CACHE STRING "Link only LibTorch's CPU libraries: AUTO (when LibTorch is a CUDA build and no CUDA toolkit is found), ON or OFF")
set_property(CACHE TWOBP_TORCH_CPU_ONLY PROPERTY STRINGS AUTO ON OFF)

macro(twobp_find_torch)
  if(NOT TARGET torch)
    _twobp_torch_prefix(_twobp_torch_root)
    set(_twobp_cpu_only OFF)
    if(TWOBP_TORCH_CPU_ONLY STREQUAL "ON")
      set(_twobp_cpu_only ON)
    elseif(TWOBP_TORCH_CPU_ONLY STREQUAL "AUTO" AND EXISTS "${_twobp_torch_root}/lib/libtorch_cuda.so")
      find_package(CUDAToolkit QUIET)
      if(NOT CUDAToolkit_FOUND)
        set(_twobp_cpu_only ON)
      endif()
    endif()
    if(_twobp_cpu_only)
      _twobp_import_torch_cpu("${_twobp_torch_root}")
    else()
      if(_twobp_torch_root AND NOT Torch_DIR)
        set(Torch_DIR "${_twobp_torch_root}/share/cmake/Torch")
      endif()
      find_package(Torch REQUIRED)
      set(TWOBP_TORCH_IMPORT "LibTorch's config")
    endif()
    unset(_twobp_cpu_only)
    unset(_twobp_torch_root)
  endif()
endmacro()

# The torch package directory (holding lib/ and share/cmake/Torch), or "" when only find_package can tell.
function(_twobp_torch_prefix out)
  set(root "")
  if(Torch_DIR)
    get_filename_component(root "${Torch_DIR}/../../.." ABSOLUTE)
  else()
    find_path(_twobp_torch_config TorchConfig.cmake PATH_SUFFIXES share/cmake/Torch Torch NO_CACHE)
    if(_twobp_torch_config)
      get_filename_component(root "${_twobp_torch_config}/../../.." ABSOLUTE)
    else()
      find_package(Python3 COMPONENTS Interpreter QUIET)
      if(Python3_FOUND)
        execute_process(
          COMMAND ${Python3_EXECUTABLE} -c
                  "import importlib.util as u, os; s = u.find_spec('torch'); print(os.path.dirname(s.origin) if s else '')"
          OUTPUT_VARIABLE root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      endif()
    endif()
  endif()
  set(${out} "${root}" PARENT_SCOPE)
endfunction()

function(_twobp_import_torch_cpu root)
  if(NOT EXISTS "${root}/lib/libtorch_cpu.so")
    message(FATAL_ERROR "twobp: LibTorch not found (looked for lib/libtorch_cpu.so in '${root}'). Run "
                        "scripts/setup.sh, or set Torch_DIR to <site-packages>/torch/share/cmake/Torch.")
  endif()
  # libtorch_cpu's CUDA runtime dependencies, from the nvidia-* wheels next to torch.
  get_filename_component(site "${root}/.." ABSOLUTE)
  file(GLOB cuda_lib_dirs LIST_DIRECTORIES true "${site}/nvidia/*/lib")  # cu13/lib, or cuda_runtime/lib (cu12)
  foreach(lib cudart cupti)
    find_file(_twobp_${lib} NAMES lib${lib}.so.13 lib${lib}.so.12 HINTS ${cuda_lib_dirs} NO_DEFAULT_PATH NO_CACHE)
    if(NOT _twobp_${lib})
      message(FATAL_ERROR "twobp: this LibTorch (${root}) is a CUDA build; its CPU library needs lib${lib} at load "
                          "time, which was not found under ${site}/nvidia. Install it with: python3 -m pip install "
                          "'cuda-toolkit[cudart,cupti]' (scripts/setup.sh does), or install the CUDA toolkit.")
    endif()
  endforeach()
  add_library(c10 SHARED IMPORTED GLOBAL)
  set_target_properties(c10 PROPERTIES IMPORTED_LOCATION "${root}/lib/libc10.so"
                                       INTERFACE_INCLUDE_DIRECTORIES "${root}/include")
  add_library(torch_cpu SHARED IMPORTED GLOBAL)
  set_target_properties(torch_cpu PROPERTIES
    IMPORTED_LOCATION "${root}/lib/libtorch_cpu.so"
    INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_RPC;USE_TENSORPIPE"
    INTERFACE_INCLUDE_DIRECTORIES "${root}/include;${root}/include/torch/csrc/api/include"
    INTERFACE_LINK_LIBRARIES c10)
  # --no-as-needed: libtorch_cpu registers its operators in static initialisers; a program that names none of its
  # symbols directly must still load it (LibTorch's config does the same).
  get_filename_component(cudart_dir "${_twobp_cudart}" DIRECTORY)
  get_filename_component(cupti_dir "${_twobp_cupti}" DIRECTORY)
  add_library(torch INTERFACE IMPORTED GLOBAL)
  set_target_properties(torch PROPERTIES
    INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed,$<TARGET_FILE:torch_cpu>,--as-needed;torch_cpu"
    INTERFACE_LINK_OPTIONS "LINKER:-rpath,${cudart_dir},-rpath,${cupti_dir},-rpath-link,${cudart_dir},-rpath-link,${cupti_dir}")
  set(Torch_FOUND TRUE PARENT_SCOPE)
  set(TORCH_INSTALL_PREFIX "${root}" PARENT_SCOPE)
  set(Torch_DIR "${root}/share/cmake/Torch" PARENT_SCOPE)  # where LibTorch's config is, as find_package sets it
  file(STRINGS "${root}/version.py" version REGEX "^__version__")
  string(REGEX REPLACE "^__version__ *= *'([^'+]*).*" "\\1" version "${version}")
  set(Torch_VERSION "${version}" PARENT_SCOPE)
  set(TWOBP_TORCH_IMPORT "CPU-only (libtorch_cpu + libc10; no CUDA toolkit)" PARENT_SCOPE)
endfunction()
