#!/usr/bin/env bash
# The GPU check: one run on a lent single-GPU machine (H200 image: pip torch 2.11 / CUDA 13 under some Python, CMake,
# ninja, 16 cores; no MPI, GoogleTest, CLI11 or nlohmann-json, no apt, no internet) that finishes in <= 8 minutes
# from a fresh copy of the tree and writes at most 8 files into OUTDIR:
#
#   summary.json         versions; gpu tests passed/failed/skipped (per test binary); F, I, W, B of one 7B stage
#                        (dim 4096, ffn 11008, 32 heads, 8 blocks, batch 1, bf16) at seq 1024 (as in the paper) and
#                        4096, with GEMM TFLOP/s and peak allocator memory; the simulated 4-GPU speedup of every
#                        schedule with 2BP over standard from those costs; the NCCL 2-process (1 GPU) result
#   build.log tests.log  configure + build output; the gpu test binaries' output
#   split_seq1024.json split_seq4096.json simulate_seq1024.json simulate_seq4096.json   twobp_bench outputs
#   check.log            everything this script printed
#
# Usage:
#   scripts/gpu_check.sh prepare            HERE: copies what the GPU image lacks into .third_party/ (git-ignored,
#                                           a few MiB): GoogleTest sources, CLI11 and nlohmann/json headers
#   scripts/gpu_check.sh --dry-run OUTDIR   HERE: everything that does not need a GPU -- prepare, configure a
#                                           separate build the way the GPU machine will (no MPI, carried third
#                                           party), check that every target and file the run needs exists and fits
#                                           the carry limit, and run the summary over a tiny CPU measurement made
#                                           with this machine's build/ (so the summary code is exercised)
#   scripts/gpu_check.sh OUTDIR             THERE (carry .third_party): the check itself
#
# Environment: PYTHON (default: the first of python3, python3.12, python that imports torch), JOBS (default nproc).
# Needs a CUDA toolkit (nvcc): the CUDA build of the torch wheel refuses find_package(Torch) without one ("Your
# installed Caffe2 version uses CUDA but I cannot find the CUDA libraries" -- seen here with /usr/local/cuda hidden;
# the wheel's nvidia/cu13 headers and libraries are not enough). The GPU image has nvcc 13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

die() { echo "gpu_check: $*" >&2; exit 1; }

find_python() {
  for p in ${PYTHON:-} python3 python3.12 python; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c "import torch" >/dev/null 2>&1; then echo "$p"; return; fi
  done
  die "no Python with torch found (set PYTHON)"
}

prepare() {
  rm -rf .third_party && mkdir -p .third_party/include
  cp -r /usr/src/googletest .third_party/googletest
  cp -r /usr/include/CLI /usr/include/nlohmann .third_party/include/
  local exclude
  exclude="$(git rev-parse --git-path info/exclude)"  # also right in a worktree, where .git is a file
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.third_party/' "$exclude" 2>/dev/null || echo '/.third_party/' >> "$exclude"
  du -sh .third_party
}

# configure BUILD_DIR: the GPU machine's configuration (no MPI, no examples, carried third party, pip torch).
configure() {
  local build_dir="$1" py="$2"
  local prefix
  prefix=$("$py" -c "import torch.utils; print(torch.utils.cmake_prefix_path)" 2>/dev/null)
  local cuda_args=()
  [[ -d /usr/local/cuda ]] && cuda_args=(-DCUDAToolkit_ROOT=/usr/local/cuda) && export PATH="/usr/local/cuda/bin:$PATH"
  local generator=(-G Ninja)
  command -v ninja >/dev/null || generator=()
  cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DTWOBP_WITH_MPI=OFF -DTWOBP_BUILD_EXAMPLES=OFF \
    -DTWOBP_GTEST_SOURCE_DIR="$ROOT/.third_party/googletest" \
    -DTWOBP_THIRD_PARTY_INCLUDE_DIR="$ROOT/.third_party/include" "${cuda_args[@]}"
}

TARGETS=(twobp_bench pipeline_cuda_test transport_nccl_processes_test)
GPU_TESTS=(tests/runtime/pipeline_cuda_test tests/transport/transport_nccl_processes_test)

# measure BUILD_DIR OUT DEVICE DTYPE DIM FFN HEADS LAYERS SEQS REPEATS: split + simulate per sequence length.
measure() {
  local build_dir="$1" out="$2" device="$3" dtype="$4" dim="$5" ffn="$6" heads="$7" layers="$8" seqs="$9"
  local repeats="${10}"
  for seq in $seqs; do
    "$build_dir/benchmarks/twobp_bench" split --device "$device" --dtype "$dtype" --dim "$dim" --ffn "$ffn" \
      --heads "$heads" --kv-heads "$heads" --layers "$layers" --seq "$seq" --batch 1 --repeats "$repeats" \
      --warmup 2 --no-conv --batched-w --micro-batches 4 --json "$out/split_seq$seq.json"
    # Costs of the fast path (twobp::nn layers) feed the simulator: 4 GPUs, 8 micro-batches, one stage per GPU
    # (two half-size chunks for interleaved-1f1b and zb-v). Communication: one [1, seq, dim] bf16 activation per
    # message; 0.1 ms is ASSUMED (NVLink moves 8-32 MiB in ~0.03-0.1 ms; one GPU cannot measure it).
    read -r f i w b < <("$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['fast']; \
print(r['forward_ms'], r['stage1_ms'], r['stage2_ms'], r['fused_ms'])" "$out/split_seq$seq.json")
    "$build_dir/benchmarks/twobp_bench" simulate --ranks 4 --microbatches 8 --f "$f" --i "$i" --w "$w" --b "$b" \
      --comm 0.1 --json "$out/simulate_seq$seq.json"
  done
}

# summarize OUT TESTJSON_DIR NVIDIA_SMI_LINE: writes OUT/summary.json from the files above.
summarize() {
  "$PY" - "$@" <<'PYEOF'
import glob, json, os, sys, datetime
out, test_dir, gpu = sys.argv[1], sys.argv[2], sys.argv[3]
summary = {"date_utc": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), "gpu": gpu}
try:
    import torch
    summary["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                           "python": sys.version.split()[0]}
except Exception as e:  # noqa: BLE001 - a summary with the reason beats no summary
    summary["versions"] = {"error": str(e)}
tests = {}
for path in sorted(glob.glob(os.path.join(test_dir, "*.json"))):
    name = os.path.basename(path)[:-5]
    try:
        j = json.load(open(path))
    except Exception as e:  # noqa: BLE001
        tests[name] = {"error": f"no gtest result ({e}); see tests.log"}
        continue
    cases = [t for s in j.get("testsuites", []) for t in s.get("testsuite", [])]
    skipped = [t for t in cases if t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN"]
    failed = [t for t in cases if t.get("failures")]
    tests[name] = {"passed": len(cases) - len(skipped) - len(failed), "failed": len(failed), "skipped": len(skipped),
                   "failed_names": [t["classname"] + "." + t["name"] for t in failed][:20]}
summary["gpu_tests"] = tests
nccl = tests.get("transport_nccl_processes_test")
summary["nccl_2_processes_1_gpu"] = (
    "not run" if nccl is None else "error: " + nccl["error"] if "error" in nccl else
    "passed" if nccl["failed"] == 0 and nccl["passed"] > 0 else
    "skipped" if nccl["failed"] == 0 else "FAILED (see tests.log)")
stages = {}
for path in sorted(glob.glob(os.path.join(out, "split_seq*.json"))):
    seq = os.path.basename(path)[len("split_seq"):-5]
    j = json.load(open(path))
    fast = j["fast"]
    stage = {k: fast.get(k) for k in ("forward_ms", "stage1_ms", "stage2_ms", "fused_ms", "batched_w_ms",
                                       "forward_tflops", "stage1_tflops", "stage2_tflops", "fused_tflops")}
    stage["general_path"] = {k: j.get("general", {}).get(k) for k in ("forward_ms", "stage1_ms", "stage2_ms", "fused_ms")}
    cfg = j.get("config", {})
    stage["peak_allocated_gib"] = cfg["peak_allocated_bytes"] / 2**30 if "peak_allocated_bytes" in cfg else None
    stage["config"] = {k: cfg.get(k) for k in ("device", "dtype", "dim", "ffn", "heads", "layers", "seq", "batch", "repeats")}
    sim_path = os.path.join(out, f"simulate_seq{seq}.json")
    if os.path.exists(sim_path):
        sim = json.load(open(sim_path))
        stage["simulated_4gpu_m8_speedup_2bp_over_standard"] = {
            r["schedule"]: r.get("speedup_vs_standard") for r in sim.get("results", []) if r.get("mode") == "2bp"}
    stages["seq" + seq] = stage
summary["stage_costs"] = stages  # one 7B stage on the GPU; a tiny model in --dry-run (see config)
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PYEOF
}

DRY=0
case "${1:-}" in
  prepare) prepare; exit 0 ;;
  --dry-run) DRY=1; shift ;;
  ""|-h|--help) sed -n 2,30p "$0"; exit 2 ;;
esac
OUT="${1:?usage: scripts/gpu_check.sh [--dry-run] OUTDIR | prepare}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee "$OUT/check.log") 2>&1
PY="$(find_python)"
JOBS="${JOBS:-$(nproc)}"
TMP="$(mktemp -d)"
start=$(date +%s)
echo "gpu_check: $(date -u '+%F %T') UTC, python $PY, $JOBS jobs, dry run $DRY"

if ((DRY)); then
  [[ -d .third_party/googletest && -f .third_party/include/CLI/CLI.hpp && -f .third_party/include/nlohmann/json.hpp ]] \
    || prepare
  size=$(du -sm .third_party | cut -f1)
  ((size <= 48)) || die ".third_party is $size MiB: with the tree it must stay under the 64 MiB carry limit"
  echo "gpu_check: .third_party is $size MiB"
  configure build-gpu-dry "$PY" > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; die "configure failed"; }
  grep "twobp:" "$OUT/build.log"
  for t in "${TARGETS[@]}"; do
    cmake --build build-gpu-dry --target help | grep -q "^$t:" || die "target $t does not exist in the GPU configuration"
    echo "gpu_check: target $t exists"
  done
  # The GPU configuration has no MPI: the NCCL transport must still be in it (bootstrapped through TCPStore).
  grep -q "NCCL ON" "$OUT/build.log" || echo "gpu_check: note: NCCL was not found here, so the GPU tests are not configured"
  # Exercise measure + summarize on this machine's build/ (CPU, tiny sizes): same code paths, no GPU numbers.
  [[ -x build/benchmarks/twobp_bench ]] || die "build/benchmarks/twobp_bench is missing: build it first"
  for t in "${GPU_TESTS[@]}"; do
    name=$(basename "$t")
    if [[ -x "build/$t" ]]; then
      "build/$t" --gtest_output="json:$TMP/$name.json" >> "$OUT/tests.log" 2>&1 || true
    fi
  done
  measure build "$OUT" cpu fp32 64 176 4 2 "16 32" 2
  summarize "$OUT" "$TMP" "dry run on $(hostname): no GPU"
  rm -rf "$TMP"
  n=$(find "$OUT" -type f | wc -l)
  ((n <= 8)) || die "$n files in $OUT: at most 8 allowed"
  echo "gpu_check: dry run OK in $(( $(date +%s) - start )) s, $n files in $OUT"
  exit 0
fi

# ---- the real run (GPU machine) ----
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n1 || echo unknown)
echo "gpu_check: GPU: $gpu"
configure build-gpu "$PY" > "$OUT/build.log" 2>&1 || { tail -n 40 "$OUT/build.log"; die "configure failed (see build.log)"; }
# Build what this configuration has (without a CUDA toolkit there is no NCCL transport, hence no NCCL test).
present=()
for t in "${TARGETS[@]}"; do
  if cmake --build build-gpu --target help | grep -q "^$t:"; then present+=("$t"); else echo "gpu_check: no target $t here"; fi
done
cmake --build build-gpu -j "$JOBS" --target "${present[@]}" >> "$OUT/build.log" 2>&1 \
  || { tail -n 40 "$OUT/build.log"; die "build failed (see build.log)"; }
grep "twobp:" "$OUT/build.log"
echo "gpu_check: built in $(( $(date +%s) - start )) s"
for t in "${GPU_TESTS[@]}"; do
  name=$(basename "$t")
  echo "== $name" >> "$OUT/tests.log"
  [[ -x "build-gpu/$t" ]] || { echo "gpu_check: $name was not built"; continue; }
  # Bounded so that the whole check stays within its 8 minutes (the NCCL test bounds its children at 150 s).
  timeout 180 "build-gpu/$t" --gtest_output="json:$TMP/$name.json" >> "$OUT/tests.log" 2>&1 \
    || echo "gpu_check: $name failed or timed out (see tests.log)"
  echo "gpu_check: $name done at $(( $(date +%s) - start )) s"
done
measure build-gpu "$OUT" cuda bf16 4096 11008 32 8 "1024 4096" 10
summarize "$OUT" "$TMP" "$gpu"
rm -rf "$TMP"
echo "gpu_check: finished in $(( $(date +%s) - start )) s"
