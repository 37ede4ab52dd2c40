#!/usr/bin/env bash
# The GPU check: one run on a lent single-GPU machine (H100/H200 image: pip torch 2.11 / CUDA 13 under some Python
# 3.12, CMake, ninja, nvcc, 16 cores; no MPI, GoogleTest, CLI11 or nlohmann-json, no apt, no internet) that ends
# within its deadline (default 450 s, for a call of <= 8 minutes) from a fresh copy of the tree, and writes exactly
# these 8 files into OUTDIR (the device returns at most 8 files of <= 16 MiB each; every log is capped at 2 MiB,
# its head and its tail):
#
#   summary.json          ALWAYS written (also after a failure, a hang, SIGTERM/SIGINT or a crash of the check):
#                         "gpu" true/false, "ok", "pieces" (every step: name, status pass|fail|timeout|skipped,
#                         seconds, detail), versions (torch, CUDA, NCCL, cuDNN, Python), GPU facts (nvidia-smi:
#                         name, memory, driver, SM/memory clocks current and max, compute and persistence mode),
#                         gpu_tests (per test binary: passed/failed/skipped/interrupted/not-run case names and
#                         failure excerpts), nccl_2_processes_1_gpu / nccl_4_processes_1_gpu, stage_costs (F, I, W, B
#                         of one 7B stage -- dim 4096, ffn 11008, 32 heads, 8 blocks, batch 1, bf16 -- at seq 1024 as
#                         in the paper and 4096, GEMM TFLOP/s, peak allocator memory, the simulated 4-GPU speedup of
#                         every schedule with 2BP over standard from those costs), example (llama_pipeline's
#                         per-step records with 2BP and without: 1B model, 4 rank threads sharing the GPU),
#                         example_memory (the example's --dry-run memory estimate against the measured peak of 3
#                         steps of the whole 7B model on one rank, with 2BP and without), test_env, deadline_s, total_s
#   check.log             what the check printed: one line per piece (its command, then its result), the
#                         environment and measurement pieces' output
#   build.log             configure and build output, per piece (absent when carried binaries stand for them)
#   tests.log             the gpu test binaries' output, per gtest suite
#   split_seq1024.json split_seq4096.json simulate_seq1024.json simulate_seq4096.json   twobp_bench outputs
#                         (seq16/seq32 in the dry run)
#
# Usage:
#   scripts/gpu_check.sh prepare            HERE: copies what the GPU image lacks into .third_party/ (git-ignored,
#                                           a few MiB): GoogleTest sources, CLI11 and nlohmann/json headers
#   scripts/gpu_check.sh --dry-run OUTDIR   HERE: everything that does not need a GPU -- prepare if needed, check
#                                           the carry size, configure a separate build the way the GPU machine will
#                                           (no MPI, carried third party) and check that every target exists, run the
#                                           gpu tests of the CPU build (they skip), measure a tiny model on the CPU
#                                           with the CPU build's twobp_bench and llama_pipeline, write the summary
#                                           ("gpu": false)
#   scripts/gpu_check.sh prebuild           HERE (optional, saves the loan minutes of the build): builds the GPU
#                                           configuration's twobp_bench, llama_pipeline and gpu tests into
#                                           build-gpu-carry (the torch wheel's CUDA build compiles and links GPU
#                                           code without a GPU) and copies them with a manifest (sources' digest,
#                                           torch version) into .gpu-prebuilt/ (git-ignored, ~15 MiB)
#   scripts/gpu_check.sh OUTDIR             THERE (carry .third_party, and .gpu-prebuilt if made): the check itself;
#                                           carried binaries stand for configure and build when they are of the same
#                                           sources and load against that machine's torch, else it builds there
#   Options (before OUTDIR): --deadline SECONDS, --build-dir DIR, --only GLOB[,GLOB] (run only the measure:/test:
#   pieces that match, e.g. a rerun of what failed; the opt-in pieces measure:example_memory* run only when
#   named). Exit status: 0 when every piece passed or was skipped for a
#   reason other than the deadline ("ok": true), 1 otherwise ("not_ok" says why), 2 on a usage error.
#
# Pieces, in order (scripts/gpu_check.py): env:nvidia-smi env:torch env:tools third_party prebuilt configure targets
# discover build:library build:twobp_bench measure:split_seqN measure:simulate_seqN (per N) build:llama_pipeline
# measure:example_2bp measure:example_standard measure:example_compare build:<gpu test>... list:<gpu test>...
# test:<gpu test>:<gtest suite or case>... measure:example_memory_{2bp,standard}{_estimate,} summary. The gpu tests
# are those ctest labels `gpu` in the GPU configuration, run one gtest suite per piece, or one case per piece in
# suites of at most 8 cases; cases matching *FourRanks* -- the 4-rank NCCL test -- run last; helper suites such as
# NcclRank, which only run as child processes, are recorded as skipped. The 7B memory pieces come last (~70 s each,
# most of it building the model on the CPU): a full run needs a deadline of ~600 s to reach them.
# Every piece has its own timeout and runs in its own process group, killed as a group (SIGTERM, SIGKILL 5 s
# later); gtest's streaming output is parsed, so the cases that passed before a kill are still reported. A
# piece's timeout is min(its own, the time left of the deadline minus 10 s for the summary); a piece that no
# longer fits is recorded as skipped with the reason; a piece whose prerequisite did not pass is skipped too.
#
# Environment:
#   PYTHON                       the Python that has torch (default: the first of .venv/bin/python, python3,
#                                python3.12, python and a few usual places where torch is found)
#   JOBS                         build parallelism (default: the number of cores)
#   GPU_CHECK_DEADLINE           overall deadline in seconds (default 450; --deadline wins)
#   GPU_CHECK_BUILD_DIR          the GPU configuration's build directory (default build-gpu; in the dry run a fresh
#                                build-gpu-dry.XXXX next to OUTDIR, removed afterwards unless GPU_CHECK_KEEP_BUILD=1)
#   GPU_CHECK_CPU_BUILD          dry run: the CPU build whose gpu tests and twobp_bench run (default build)
#   GPU_CHECK_MAX_PIECE_SECONDS  caps every piece's timeout (default: none)
#   GPU_CHECK_TEST_TIMEOUT       timeout of one test piece (default 240 s, at most ctest's TIMEOUT; the last
#                                pieces get ctest's TIMEOUT)
#   GPU_CHECK_PREBUILT           the carried binaries' directory (default .gpu-prebuilt; the dry run uses carried
#                                binaries only when this is set)
#   GPU_CHECK_INJECT             fault injection, e.g. "env:tools:hang,measure:split_seq16:fail": the pieces whose
#                                names match the glob before the last ':' run a command that fails (exit 1) or hangs
#                                (in its process group, ignoring SIGTERM); "crash" makes the check itself raise there
#   NCCL_DEBUG, NCCL_DEBUG_SUBSYS, NCCL_MNNVL_ENABLE, TWOBP_TEST_STACKS_ON_HANG   set for every piece unless
#                                already set: WARN, INIT,NET, 0, 1 (a multi-process test prints a stuck rank's stacks
#                                with cuda-gdb/gdb before killing it)
#                                (recorded in summary.json's test_env)
#
# Needs a CUDA toolkit (nvcc) on the GPU machine: the CUDA build of the torch wheel refuses find_package(Torch)
# without one ("Your installed Caffe2 version uses CUDA but I cannot find the CUDA libraries" -- seen here with
# /usr/local/cuda hidden; the wheel's nvidia/cu13 headers and libraries are not enough). The GPU image has nvcc 13.0.
# Tests: ctest -L script (tests/scripts: gpu_check_dry_run, gpu_check_injected, gpu_check_prebuilt,
# gpu_check_prebuilt_stale).
set -uo pipefail
export GPU_CHECK_T0="${GPU_CHECK_T0:-$(date +%s.%N)}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

case "${1:-}" in
  ""|-h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac

# A Python >= 3.9 with the torch package (found without importing it: a CPU-only install cannot import it).
has_torch() {
  "$1" -c 'import sys, importlib.util as u; sys.exit(0 if sys.version_info >= (3, 9) and u.find_spec("torch") else 1)' \
    >/dev/null 2>&1
}
is_py39() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 9) else 1)' >/dev/null 2>&1; }

candidates=()
[[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
candidates+=("$ROOT/.venv/bin/python" python3 python3.12 python /usr/local/bin/python3* /usr/bin/python3.1[0-9]
             /opt/conda/bin/python /opt/*/bin/python3 "$HOME"/.venv/bin/python "$HOME"/venv/bin/python)
torch_py=""
run_py=""
for p in "${candidates[@]}"; do
  path="$(command -v "$p" 2>/dev/null)" || continue
  [[ -x "$path" ]] || continue
  if has_torch "$path"; then torch_py="$path"; break; fi
  [[ -z "$run_py" ]] && is_py39 "$path" && run_py="$path"
done
[[ -n "$torch_py" ]] && run_py="$torch_py"
export GPU_CHECK_TORCH_PYTHON="$torch_py"

if [[ -z "$run_py" ]]; then
  echo "gpu_check: no Python >= 3.9 found (set PYTHON)" >&2
  out="${!#}"  # still leave a summary where one is expected
  if [[ "$1" != prepare && -n "$out" && "$out" != -* ]]; then
    mkdir -p "$out" && printf '{"gpu": false, "ok": false, "pieces": [], "error": "no Python >= 3.9 found"}\n' \
      > "$out/summary.json"
  fi
  exit 1
fi
exec "$run_py" "$ROOT/scripts/gpu_check.py" "$@"
