#!/usr/bin/env bash
# Installs what twobp needs and is missing; safe to run any number of times. Sourced by the other scripts.
#   Debian packages: compiler, CMake, Ninja, Open MPI, GoogleTest, Google Benchmark, CLI11, nlohmann/json, ccache
#   PyPI: torch (LibTorch's headers, libraries and CMake config ship in the wheel), reframe-hpc (the ReFrame checks
#         of benchmarks/reframe; ctest loads them and writes their Slurm job scripts, it does not run them)
set -euo pipefail

# LibTorch 2.11.0: its default PyPI build is for CUDA 13.0, the toolkit on our machines, so the NCCL transport
# compiles and links against the same CUDA and NCCL that LibTorch loads; it is also the version on the GPU image.
TWOBP_TORCH_VERSION="${TWOBP_TORCH_VERSION:-2.11.0}"
TWOBP_REFRAME_VERSION="${TWOBP_REFRAME_VERSION:-4.10.4}"
# ccache: hash paths relative to the checkout (and ignore the build directory in -g builds), so that another clone
# of the same tree (CI's, a worktree's) reuses the cache. Harmless where ccache is not installed.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
PYTHON="${PYTHON:-python3}"

twobp_setup() {
  local packages=(g++ cmake ninja-build make libopenmpi-dev openmpi-bin libgtest-dev libbenchmark-dev libcli11-dev
                  nlohmann-json3-dev ccache python3-pip)
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    # python3-pip is only needed when the interpreter has no pip of its own (pyenv builds bring one).
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
      missing=("${missing[@]/python3-pip/}")
    fi
  fi
  local to_install=()
  for p in "${missing[@]}"; do [[ -n "$p" ]] && to_install+=("$p"); done
  if ((${#to_install[@]})); then
    echo "twobp setup: installing Debian packages: ${to_install[*]}"
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${to_install[@]}" >/dev/null
  fi
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TWOBP_TORCH_VERSION' else 1)" \
      >/dev/null 2>&1; then
    echo "twobp setup: installing torch==$TWOBP_TORCH_VERSION from PyPI (LibTorch for C++)"
    "$PYTHON" -m pip install -q "torch==$TWOBP_TORCH_VERSION"
  fi
  if ! "$PYTHON" -c "import reframe, sys; sys.exit(0 if reframe.VERSION == '$TWOBP_REFRAME_VERSION' else 1)" \
      >/dev/null 2>&1; then
    echo "twobp setup: installing reframe-hpc==$TWOBP_REFRAME_VERSION from PyPI (benchmarks/reframe)"
    "$PYTHON" -m pip install -q "reframe-hpc==$TWOBP_REFRAME_VERSION"
  fi
}

# Configures and builds into build/ (or $TWOBP_BUILD_DIR) with at most $TWOBP_JOBS (default: cores) jobs.
twobp_build() {
  local build_dir="${TWOBP_BUILD_DIR:-build}"
  local jobs="${TWOBP_JOBS:-$(nproc)}"
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  [[ -d /usr/local/cuda/bin ]] && export PATH="/usr/local/cuda/bin:$PATH"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" ${TWOBP_CMAKE_ARGS:-}
  cmake --build "$build_dir" -j "$jobs"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  cd "$(dirname "$0")/.."
  twobp_setup
fi
