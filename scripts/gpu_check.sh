#!/usr/bin/env bash
# The GPU check, prepared to run in one call on a lent GPU machine (H200 image: torch 2.11 CUDA 13, CMake, ninja,
# NCCL from pip, no internet, maybe no MPI). Two halves:
#
#   scripts/gpu_check.sh prepare     HERE: copies what the image lacks into .third_party/ (git-ignored): the
#                                    GoogleTest sources, CLI11 and nlohmann/json headers.
#   scripts/gpu_check.sh run OUTDIR  THERE (carry .third_party): builds twobp with the GPU code, runs the gpu
#                                    tests, then measures one 7B stage (8 LLaMa-7B blocks, bf16, one sequence of
#                                    2048 tokens per micro-batch): F, I, W, B times and TFLOP/s, feeds them to the
#                                    simulator for the 4-GPU prediction of 2BP against standard, and runs the
#                                    example on the GPU (two stages on one GPU, Local transport).
#
# Status: written without a GPU to try it on; its first real run is still to come.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  prepare)
    rm -rf .third_party && mkdir -p .third_party/include
    cp -r /usr/src/googletest .third_party/googletest
    cp -r /usr/include/CLI /usr/include/nlohmann .third_party/include/
    grep -qx '/.third_party/' .git/info/exclude 2>/dev/null || echo '/.third_party/' >> .git/info/exclude
    du -sh .third_party
    ;;
  run)
    out="${2:?usage: scripts/gpu_check.sh run OUTDIR}"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DTWOBP_GTEST_SOURCE_DIR="$PWD/.third_party/googletest" \
      -DTWOBP_THIRD_PARTY_INCLUDE_DIR="$PWD/.third_party/include" 2>&1 | tee "$out/configure.log" | grep "twobp:"
    cmake --build build-gpu -j "$(nproc)" 2>&1 | tail -n 3
    ctest --test-dir build-gpu -L "gpu|parity" --output-on-failure 2>&1 | tee "$out/ctest.log" | tail -n 15
    # One 7B stage: 8 of the 32 blocks (a 4-stage split), bf16, micro-batch of one 2048-token sequence.
    build-gpu/benchmarks/twobp_bench split --device cuda --dtype bf16 --dim 4096 --ffn 11008 --heads 32 \
      --kv-heads 32 --layers 8 --seq 2048 --batch 1 --repeats 10 --warmup 3 --no-conv --batched-w \
      --micro-batches 4 --json "$out/split_7b_stage.json" | tee "$out/split_7b_stage.txt"
    # Communication: one [1, 2048, 4096] bf16 activation (16 MiB) over NVLink at ~300 GB/s is ~0.06 ms; 0.1 ms
    # is assumed here (there is one GPU to measure on).
    read -r f i w b < <(python3 -c "import json; r=json.load(open('$out/split_7b_stage.json'))['fast']; \
print(r['forward_ms'], r['stage1_ms'], r['stage2_ms'], r['fused_ms'])")
    for m in 8 16 32; do
      build-gpu/benchmarks/twobp_bench simulate --ranks 4 --microbatches "$m" --f "$f" --i "$i" --w "$w" --b "$b" \
        --comm 0.1 --json "$out/simulate_4gpu_m$m.json" | tee "$out/simulate_4gpu_m$m.txt"
    done
    build-gpu/examples/llama_pipeline --model small --device cuda --dtype bf16 --stages 2 --steps 20 \
      --json "$out/example_cuda.json" 2>&1 | tee "$out/example_cuda.txt" | tail -n 5
    ;;
  *)
    echo "usage: scripts/gpu_check.sh prepare | run OUTDIR" >&2
    exit 2
    ;;
esac
