#!/usr/bin/env bash
# Builds one libFuzzer target (clang, ASan + UBSan) into build-fuzz/ and fuzzes it for SECONDS, starting from its
# committed corpus tests/fuzz/corpus/TARGET/. Installs what is missing first (scripts/setup.sh, clang).
#
#   scripts/fuzz.sh TARGET SECONDS [extra libFuzzer flags, e.g. -jobs=2 or -only_ascii=1]
#   TARGET: schedule_text | token_file        (reproduce a finding: build-fuzz/fuzz/fuzz_TARGET FILE)
#
# New inputs go to a scratch corpus (build-fuzz/corpus/TARGET/). At the end the committed corpus is minimised
# with -merge=1: it keeps its hand-picked files (seed-*, regress-*, findings) plus the fewest new inputs that
# add coverage beyond them. A finding (crash, leak, timeout, out-of-memory) is written to the committed corpus
# directory as crash-* / leak-* / timeout-* / oom-*: the replay test (fuzz_replay) skips such files until
# the bug is fixed and the file is renamed regress-*. Exit status: libFuzzer's (0: nothing found).
# Environment: TWOBP_JOBS (build jobs), CLANGXX (default clang++-14), TWOBP_FUZZ_BUILD_DIR (default build-fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

if [[ $# -lt 2 || ! "$2" =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh TARGET SECONDS [libFuzzer flags...]   (TARGET: schedule_text, token_file)" >&2
  exit 2
fi
target="$1" seconds="$2"
shift 2
corpus="tests/fuzz/corpus/$target"
[[ -d "$corpus" ]] || { echo "fuzz.sh: unknown target '$target' (no $corpus/)" >&2; exit 2; }
build_dir="${TWOBP_FUZZ_BUILD_DIR:-build-fuzz}"
CLANGXX="${CLANGXX:-clang++-14}"

twobp_setup
if ! command -v "$CLANGXX" >/dev/null || ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a \
    >/dev/null 2>&1; then
  echo "fuzz.sh: installing clang-14 and its runtimes (libFuzzer)"
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clang-14 libclang-rt-14-dev >/dev/null
fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Only the library and the fuzzers: no tests, examples, benchmarks, MPI or NCCL. fuzzer-no-link instruments
# libtwobp for coverage; the fuzz_* executables add -fsanitize=fuzzer (libFuzzer's main) themselves.
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_CXX_COMPILER="$CLANGXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -fno-sanitize-recover=undefined" \
      -DTWOBP_SANITIZE=fuzzer-no-link,address,undefined -DTWOBP_BUILD_FUZZERS=ON -DTWOBP_BUILD_TESTS=OFF \
      -DTWOBP_BUILD_EXAMPLES=OFF -DTWOBP_BUILD_BENCHMARKS=OFF -DTWOBP_WITH_MPI=OFF -DTWOBP_WITH_NCCL=OFF \
      "${launcher[@]}" >/dev/null
cmake --build "$build_dir" -j "${TWOBP_JOBS:-$(twobp_cores)}" --target "fuzz_$target"
fuzzer="$build_dir/fuzz/fuzz_$target"

# detect_leaks stays on (per input; LibTorch's one-time allocations at start-up are not checked by libFuzzer).
# protect_shadow_gap=0 for LibTorch's CUDA libraries on GPU machines; detect_odr_violation=0: fmt's header-only
# globals are in LibTorch and in our objects.
export ASAN_OPTIONS="protect_shadow_gap=0:detect_odr_violation=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
# Allocations beyond 256 MB are refused (bad_alloc, which the targets report as a finding) instead of killing
# the run as an OOM: an input must never make the parsers allocate by what a header claims.
ASAN_OPTIONS="$ASAN_OPTIONS:max_allocation_size_mb=256:allocator_may_return_null=1"
# The fuzzer reads and extends a scratch copy of the committed corpus without its findings (a known crash would
# stop every run at start-up).
is_finding=(-name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'slow-unit-*')
work="$build_dir/corpus/$target"
mkdir -p "$work"
find "$corpus" -maxdepth 1 -type f ! \( "${is_finding[@]}" \) -exec cp {} "$work/" \;
dict=()
[[ -f "tests/fuzz/$target.dict" ]] && dict=(-dict="tests/fuzz/$target.dict")

set +e
"$fuzzer" "$work" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$corpus/" -print_final_stats=1 "$@"
status=$?
set -e

# Minimise: the hand-picked files first, then only the inputs that add coverage to them.
merged="$(mktemp -d)"
trap 'rm -rf "$merged"' EXIT
find "$corpus" -maxdepth 1 -type f \( -name 'seed-*' -o -name 'regress-*' \) -exec cp {} "$merged/" \;
picked_count=$(find "$merged" -type f | wc -l)
# -use_counters=0: a new edge earns an input its place, a new hit count of a known edge does not (fewer files).
# Inputs that hit a bug fail here, so the merge leaves them out (the replay test would fail on them); their
# artifacts go to a scratch directory.
merge_artifacts="$(mktemp -d)"
trap 'rm -rf "$merged" "$merge_artifacts"' EXIT
"$fuzzer" -merge=1 -use_counters=0 "$merged" "$work" "${dict[@]}" -timeout=10 \
  -rss_limit_mb=2048 -artifact_prefix="$merge_artifacts/" 2>&1 | grep -E "^MERGE-OUTER: [0-9]+ new files" || true
find "$corpus" -maxdepth 1 -type f ! -name 'seed-*' ! -name 'regress-*' ! \( "${is_finding[@]}" \) -delete
find "$merged" -maxdepth 1 -type f ! -name 'seed-*' ! -name 'regress-*' -exec cp {} "$corpus/" \;
echo "fuzz.sh: $target: committed corpus = $picked_count hand-picked + $(( $(find "$merged" -type f | wc -l) - picked_count )) merged inputs; libFuzzer exit status $status"
exit $status
