#!/usr/bin/env bash
# Installs what twobp needs and is missing; safe to run any number of times. Sourced by the other scripts.
#   Debian packages: compiler, CMake, Ninja, Open MPI, GoogleTest, Google Benchmark, CLI11, nlohmann/json, ccache,
#                    python3-venv
#   PyPI, into a virtual environment owned by the checkout (.venv/, or $TWOBP_VENV; Debian's own Python refuses
#   `pip install` outside one, PEP 668):
#     torch        LibTorch's headers, libraries and CMake config ship in the wheel. Which install (TWOBP_TORCH_KIND):
#                  cuda  the wheel with its NVIDIA packages (about 3.9 GB on disk, ~1 min here): the NCCL transport
#                        is built. Chosen by `auto` (the default) when a CUDA toolkit (nvcc) is found.
#                  cpu   the wheel alone plus the CUDA runtime and CUPTI wheels (530 MB download, 1.3 GB on disk,
#                        ~15 s here), which its CPU library loads; the build links LibTorch's CPU libraries only
#                        (cmake/TwobpTorch.cmake) and needs no CUDA toolkit. Chosen by `auto` without a toolkit.
#                        Python's `import torch` does not work in this install (nothing of twobp needs it; the peer
#                        benchmark benchmarks/peer does).
#     reframe-hpc  the ReFrame checks of benchmarks/reframe (ctest loads them and writes their Slurm job scripts)
#     transformers, safetensors, tokenizers  tests/models/hf_compare.py (ctest hf_llama_compare) compares twobp's
#                  Llama with transformers' LlamaForCausalLM (it needs Python's `import torch` too, the cuda
#                  install); scripts/tokens.py --tokenizer and tests/data/tokens_script_test.py use tokenizers. The
#                  tests report SKIP without them. The library reads and writes safetensors itself.
set -euo pipefail

# LibTorch 2.11.0: its default PyPI build is for CUDA 13.0, the toolkit on our machines, so the NCCL transport
# compiles and links against the same CUDA and NCCL that LibTorch loads; it is also the version on the GPU image.
TWOBP_TORCH_VERSION="${TWOBP_TORCH_VERSION:-2.11.0}"
# The torch wheel's own pin of the CUDA runtime (its Requires-Dist: cuda-toolkit[...]==13.0.2).
TWOBP_CUDA_WHEELS_VERSION="${TWOBP_CUDA_WHEELS_VERSION:-13.0.2}"
TWOBP_REFRAME_VERSION="${TWOBP_REFRAME_VERSION:-4.10.4}"
TWOBP_TRANSFORMERS_VERSION="${TWOBP_TRANSFORMERS_VERSION:-5.25.0}"
TWOBP_SAFETENSORS_VERSION="${TWOBP_SAFETENSORS_VERSION:-0.8.0}"
TWOBP_TOKENIZERS_VERSION="${TWOBP_TOKENIZERS_VERSION:-0.23.3}"
TWOBP_VENV="${TWOBP_VENV:-$PWD/.venv}"
# ccache: hash paths relative to the checkout (and ignore the build directory in -g builds), so that another clone
# of the same tree (CI's, a worktree's) reuses the cache. Harmless where ccache is not installed.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
# Precompiled headers (cmake/TwobpPch.cmake): ccache caches the PCH and the objects built with it only with these.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros}"
[[ -d /usr/local/cuda/bin ]] && export PATH="/usr/local/cuda/bin:$PATH"

# cuda or cpu, as described above.
# The machine's cores, for build and test jobs. Not plain nproc: GNU nproc answers OMP_NUM_THREADS when it is set,
# and scripts/test.sh sets it to 1 for the tests themselves (one intra-op thread per test process).
twobp_cores() {
  env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc
}

twobp_torch_kind() {
  local kind="${TWOBP_TORCH_KIND:-auto}"
  if [[ "$kind" == auto ]]; then
    # A working nvcc, not just a name on PATH (a link into a toolkit that is gone).
    if nvcc --version >/dev/null 2>&1; then kind=cuda; else kind=cpu; fi
  fi
  case "$kind" in
    cuda|cpu) echo "$kind" ;;
    *) echo "twobp setup: TWOBP_TORCH_KIND must be auto, cuda or cpu (got '$kind')" >&2; return 2 ;;
  esac
}

# Runs pip quietly; on failure shows what it said.
twobp_pip() {
  local log
  log="$(mktemp)"
  if ! "$TWOBP_VENV/bin/python" -m pip install --disable-pip-version-check "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "twobp setup: pip install $* failed" >&2
    return 1
  fi
  rm -f "$log"
}

twobp_setup() {
  local packages=(g++ cmake ninja-build make libopenmpi-dev openmpi-bin libgtest-dev libbenchmark-dev libcli11-dev
                  nlohmann-json3-dev ccache python3-venv)
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "twobp setup: installing Debian packages: ${missing[*]}"
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi

  if [[ ! -x "$TWOBP_VENV/bin/python" ]]; then
    echo "twobp setup: creating the virtual environment $TWOBP_VENV (${TWOBP_PYTHON:-python3})"
    "${TWOBP_PYTHON:-python3}" -m venv "$TWOBP_VENV"
  fi
  local kind stamp want
  kind="$(twobp_torch_kind)"
  stamp="$TWOBP_VENV/twobp-torch"
  want="torch $TWOBP_TORCH_VERSION $kind"
  if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    if [[ "$kind" == cuda ]]; then
      echo "twobp setup: installing torch==$TWOBP_TORCH_VERSION with its NVIDIA packages from PyPI (about 3.9 GB)"
      twobp_pip "torch==$TWOBP_TORCH_VERSION"
    else
      echo "twobp setup: installing torch==$TWOBP_TORCH_VERSION for the CPU from PyPI (the wheel and the CUDA" \
           "runtime it loads, about 540 MB; no CUDA toolkit here)"
      twobp_pip --no-deps "torch==$TWOBP_TORCH_VERSION"
      twobp_pip "cuda-toolkit[cudart,cupti]==$TWOBP_CUDA_WHEELS_VERSION"
    fi
    echo "$want" >"$stamp"
  fi
  if ! "$TWOBP_VENV/bin/python" -c "import reframe, sys; sys.exit(0 if reframe.VERSION == '$TWOBP_REFRAME_VERSION' else 1)" \
      >/dev/null 2>&1; then
    echo "twobp setup: installing reframe-hpc==$TWOBP_REFRAME_VERSION from PyPI (benchmarks/reframe)"
    twobp_pip "reframe-hpc==$TWOBP_REFRAME_VERSION"
  fi
  if ! "$TWOBP_VENV/bin/python" -c "import sys, transformers, safetensors, tokenizers; sys.exit(0 if \
(transformers.__version__, safetensors.__version__, tokenizers.__version__) == ('$TWOBP_TRANSFORMERS_VERSION', \
'$TWOBP_SAFETENSORS_VERSION', '$TWOBP_TOKENIZERS_VERSION') else 1)" >/dev/null 2>&1; then
    echo "twobp setup: installing transformers==$TWOBP_TRANSFORMERS_VERSION, safetensors==$TWOBP_SAFETENSORS_VERSION" \
         "and tokenizers==$TWOBP_TOKENIZERS_VERSION from PyPI (tests/models/hf_compare.py, scripts/tokens.py)"
    twobp_pip "transformers==$TWOBP_TRANSFORMERS_VERSION" "safetensors==$TWOBP_SAFETENSORS_VERSION" \
      "tokenizers==$TWOBP_TOKENIZERS_VERSION"
  fi
}

# CMake, the tests and the programs see the virtual environment's Python (its torch and reframe-hpc).
twobp_use_venv() {
  export VIRTUAL_ENV="$TWOBP_VENV"
  export PATH="$TWOBP_VENV/bin:$PATH"
}

# Configures and builds into build/ (or $TWOBP_BUILD_DIR) with at most $TWOBP_JOBS (default: cores) jobs: the
# given targets, or everything. CMake and the tests see the virtual environment's Python (and so its torch).
twobp_build() {
  local build_dir="${TWOBP_BUILD_DIR:-build}"
  local jobs="${TWOBP_JOBS:-$(twobp_cores)}"
  local launcher=() targets=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  (($#)) && targets=(--target "$@")
  twobp_use_venv
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$TWOBP_VENV/bin/python" \
    "${launcher[@]}" ${TWOBP_CMAKE_ARGS:-}
  cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  cd "$(dirname "$0")/.."
  twobp_setup
fi
