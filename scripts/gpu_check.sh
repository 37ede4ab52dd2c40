#!/usr/bin/env bash
# The GPU check: one run on a lent single-GPU machine (H100/H200 image: pip torch 2.11 / CUDA 13 under some Python
# 3.12, CMake, ninja, nvcc, 16 cores; no MPI, GoogleTest, CLI11 or nlohmann-json, no apt, no internet) that ends
# within its deadline from a fresh copy of the tree and writes at most 8 files into OUTDIR (the device returns at
# most 8 files of <= 16 MiB each; every log is capped at 2 MiB, its head and its tail). Two profiles
# (scripts/gpucheck/profiles.py says which pieces each runs, in which order):
#
#   default  (deadline 450 s, a call of <= 8 minutes) the gpu test suites and the default measurements; files:
#   summary.json          ALWAYS written (also after a failure, a hang, SIGTERM/SIGINT or a crash of the check):
#                         "gpu" true/false, "ok", "profile", "pieces" (every step: name, status
#                         pass|fail|timeout|skipped, seconds, detail), versions (torch, CUDA, NCCL, cuDNN, Python),
#                         GPU facts (nvidia-smi: name, memory, driver, SM/memory clocks current and max, compute and
#                         persistence mode, power draw and limit), gpu_tests (per test binary:
#                         passed/failed/skipped/interrupted/not-run case names and failure excerpts),
#                         nccl_2_processes_1_gpu / nccl_4_processes_1_gpu, stage_costs (F, I, W, B of one 7B stage --
#                         dim 4096, ffn 11008, 32 heads, 8 blocks, batch 1, bf16 -- at seq 1024 as in the paper and
#                         4096, GEMM TFLOP/s, peak allocator memory, the simulated 4-GPU speedup of every schedule
#                         with 2BP over standard from those costs), example (llama_pipeline's per-step records with
#                         2BP and without: 1B model, 4 rank threads sharing the GPU), example_memory (the example's
#                         --dry-run memory estimate against the measured peak of 3 steps of the whole 7B model on one
#                         rank, with 2BP and without), test_env, deadline_s, total_s
#   check.log             what the check printed: one line per piece (its command, then its result), the
#                         environment and measurement pieces' output
#   build.log             configure and build output, per piece (absent when carried binaries stand for them)
#   tests.log             the gpu test binaries' output, per gtest suite
#   split_seq1024.json split_seq4096.json simulate_seq1024.json simulate_seq4096.json   twobp_bench outputs
#                         (seq16/seq32 in the dry run)
#
#   perf  (--profile perf; --part 1 or --part 2, deadline 280 s each, a call of <= 5 minutes, so that both and a
#   machine start fit 15 minutes of device time; both parts when no part is named, 560 s) the performance evidence of
#   issue 61, pieces by value, each with its own timeout; what does not fit the deadline is skipped (and waits for
#   the next loan). Sizes are chosen per card by llama_pipeline's own --dry-run memory estimate (largest first,
#   +1 GiB per process, within 85 % of the card): an H100 80 GB and an H200 both run, the summary says which sizes.
#     part 1: env:* and env:peak_tflops (GPU kind, clocks, power limit; the peak dense bf16 TFLOP/s from the
#             datasheet table in scripts/gpucheck/environment.py), the numerics gate (gate:split_cuda_test: the gpu
#             test of the split's CUDA-only paths; gate:split_check_{bf16-pure,bf16}: split's fast vs general path
#             with --check, accumulating W included; never left out by --only), probe:split_options (fails unless
#             twobp_bench split --help offers --dtype bf16 and bf16-pure and --paths fast),
#             measure:split_seq1024_{bf16-pure,bf16} (one 7B stage, all-bfloat16 and mixed precision, with
#             every column the JSON has: issue 57's host/device-timed/ops-per-block/overhead/accumulation columns when
#             present), measure:stage_costs_size_m<M>_seq<S> (the size), measure:stage_costs_{2bp,standard} (the
#             real partition: llama_pipeline --model 7b --ranks 1 --chunks-per-rank 4, interleaved-1f1b with p = 1,
#             bf16-pure, --costs-json), measure:plan_4gpu (twobp_bench plan --costs-json both: every schedule x mode
#             on 4 GPUs, one replica, m = 8, 0.1 ms per activation message ASSUMED), measure:split_seq4096_*
#     part 2: measure:nccl4_size_m<M>_seq<S>, measure:nccl4_{1f1b,zb-v}_{2bp,standard} (the 7B job as 4 processes
#             over NCCL on the one GPU: scripts/gpucheck/launch.py gives each torchrun's variables, a TCPStore
#             rendezvous and its own NCCL_HOSTID; bf16-pure, 2 steps; each run's peak memory within 10 % of the
#             --dry-run estimate), measure:nccl4_compare (the first step's loss identical, its gradient norm
#             within tolerance across them),
#             measure:nccl4_1f1b_2bp_bf16 (mixed precision, where the card holds the float32 masters),
#             measure:green_contexts (skipped: not implemented)
#   summary.json          as above (no gpu_tests) plus "part", peak_bf16_tflops, numerics_gate (part 1: the gate's
#                         cases and fast-vs-general comparisons), split (runs: headline numbers and
#                         new columns; targets: issue 57's, judged at seq 1024), stage_costs_real_partition (sizing,
#                         per-stage costs of each mode, plan_4gpu: message time assumed and why, per schedule the
#                         fastest of each mode, 2BP/standard and each over 1F1B standard), nccl_4_processes (sizing,
#                         runs: losses, tokens/s, memory against the estimate; first_step), green_contexts
#   check.log, build.log  as above
#   split.json            part 1: every split run's twobp_bench JSON, by seq<N>_<dtype>
#   costs_2bp.json costs_standard.json plan.json   part 1: llama_pipeline --costs-json and twobp_bench plan outputs
#   nccl4.json            part 2: every 4-process run's llama_pipeline JSON with the estimate per rank
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
#   scripts/gpu_check.sh --profile perf [--part 1|2] --dry-run OUTDIR
#                                           HERE: the perf profile on the CPU build's binaries (no configure): tiny
#                                           sizes (seq 16/32, a tiny 8-block model, the split in bf16-pure and bf16
#                                           as on the GPU), 4 CPU processes over the StoreTransport standing for the GPU's
#   scripts/gpu_check.sh prebuild           HERE (optional, saves the loan minutes of the build): builds the GPU
#                                           configuration's twobp_bench, llama_pipeline and gpu tests into
#                                           build-gpu-carry (the torch wheel's CUDA build compiles and links GPU
#                                           code without a GPU) and copies them with a manifest (sources' digest,
#                                           torch version) into .gpu-prebuilt/ (git-ignored, ~15 MiB)
#   scripts/gpu_check.sh [--profile perf --part N] OUTDIR
#                                           THERE (carry .third_party, and .gpu-prebuilt if made -- the perf profile
#                                           needs it: a build there takes most of a part's 5 minutes): the check
#                                           itself; carried binaries stand for configure and build when they are of
#                                           the same sources and load against that machine's torch, else it builds
#   Options (before OUTDIR): --profile default|perf, --part 1|2 (perf), --deadline SECONDS, --build-dir DIR,
#   --only GLOB[,GLOB] (run only the measure:/test: pieces that match, e.g. a rerun of what failed or was skipped
#   for the deadline; the default profile's opt-in pieces measure:example_memory* run only when named). Exit
#   status: 0 when every piece passed or was skipped for a reason other than the deadline ("ok": true), 1 otherwise
#   ("not_ok" says why), 2 on a usage error.
#
# Default profile's pieces, in order: env:nvidia-smi env:torch env:tools third_party prebuilt configure targets
# discover build:library build:twobp_bench measure:split_seqN measure:simulate_seqN (per N) build:llama_pipeline
# measure:example_2bp measure:example_standard measure:example_compare build:<gpu test>... list:<gpu test>...
# test:<gpu test>:<gtest suite or case>... measure:example_memory_{2bp,standard}{_estimate,} summary. The gpu tests
# are those ctest labels `gpu` in the GPU configuration, run one gtest suite per piece, or one case per piece in
# suites of at most 8 cases; cases matching *FourRanks* -- the 4-rank NCCL test -- run last; helper suites such as
# NcclRank, which only run as child processes, are recorded as skipped. The 7B memory pieces come last (~70 s each,
# most of it building the model on the CPU): a full run needs a deadline of ~600 s to reach them. The default
# profile measures nothing the perf profile does at its sizes but the split at seq 1024/4096 (--only 'test:*'
# leaves it out when both profiles run on one loan).
# Every piece has its own timeout and runs in its own process group, killed as a group (SIGTERM, SIGKILL 5 s
# later); gtest's streaming output is parsed, so the cases that passed before a kill are still reported. A
# piece's timeout is min(its own, the time left of the deadline minus 10 s for the summary); a piece that no
# longer fits is recorded as skipped with the reason; a piece whose prerequisite did not pass is skipped too.
#
# Environment:
#   PYTHON                       the Python that has torch (default: the first of .venv/bin/python, python3,
#                                python3.12, python and a few usual places where torch is found)
#   JOBS                         build parallelism (default: the number of cores)
#   GPU_CHECK_DEADLINE           overall deadline in seconds (default 450; perf 280 per part; --deadline wins)
#   GPU_CHECK_BUILD_DIR          the GPU configuration's build directory (default build-gpu; in the dry run a fresh
#                                build-gpu-dry.XXXX next to OUTDIR, removed afterwards unless GPU_CHECK_KEEP_BUILD=1)
#   GPU_CHECK_CPU_BUILD          dry run: the CPU build whose gpu tests, twobp_bench and llama_pipeline run (default
#                                build)
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
# Tests: ctest -L script (tests/scripts: gpu_check_dry_run, gpu_check_injected, gpu_check_prebuilt;
# gpu_check_perf_part1, gpu_check_perf_part2, gpu_check_perf_injected).
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
