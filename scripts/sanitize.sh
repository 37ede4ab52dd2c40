#!/usr/bin/env bash
# Builds the test suite with sanitizers and runs it with ctest. Installs what is missing first (scripts/setup.sh).
#
#   scripts/sanitize.sh [asan|tsan] [extra ctest arguments, e.g. -L unit or -R schedule]
#
#   asan  build-asan/, -fsanitize=address,undefined for the library (tests/ with address only): the tests labelled
#         "sanitize" (every part of src/, the thread, store and MPI transports; docs/TESTING.md lists them and what
#         each covers), built alone (target twobp_sanitize_targets; no benchmarks, no example, no NCCL: its code runs
#         only on a GPU), their parameter grids reduced (TWOBP_TEST_SCALE=reduced: every kind of case, fewer
#         repetitions; tests/common/test_scale.h).
#   tsan  build-tsan/, -fsanitize=thread, only what runs several ranks as threads of one process: the Local
#         transport tests, the pipeline, split-class, executor, run_ranks, data-parallel, memory (counter and limit)
#         and mixed-precision tests on threads (MPI ranks are separate processes, which
#         TSan cannot relate, and Open MPI is not instrumented).
#
# LibTorch, Open MPI and libgomp are not instrumented; the runtime options and the suppression files written
# below (into <build dir>/sanitizer-supp/) say what is tolerated from them and why. Environment: TWOBP_JOBS (build jobs, default
# cores), TWOBP_CMAKE_ARGS (extra configure arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

mode="${1:-asan}"
[[ $# -gt 0 ]] && shift
case "$mode" in
  asan) build_dir=build-asan; sanitize="address,undefined" ;;
  tsan) build_dir=build-tsan; sanitize="thread" ;;
  *) echo "usage: scripts/sanitize.sh [asan|tsan] [ctest arguments...]" >&2; exit 2 ;;
esac
supp_dir="$PWD/$build_dir/sanitizer-supp"

twobp_setup

jobs="${TWOBP_JOBS:-$(twobp_cores)}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
[[ -d /usr/local/cuda/bin ]] && export PATH="/usr/local/cuda/bin:$PATH"
# -O1 -g1: line numbers in reports, asserts on, still fast enough (the heavy math runs in the optimised LibTorch).
mpi_flags=()
if [[ "$mode" == asan ]]; then
  # MPI ranks (started by mpiexec): ASan's memory checks, no leak check. Attributing Open MPI's own leaks (its
  # dlclose()d plugins) needs the slow unwinder on every malloc, which made each MPI test 15x slower (pipeline_mpi_test
  # 86 s instead of 5.5 s, 2026-12-06) and CI overran; and LeakSanitizer's tracer crashed at the exit of 4 ranks.
  # The same library code is leak-checked on rank threads and in the Store transport's processes.
  mpi_flags=("-DTWOBP_MPIEXEC_FLAGS=-x;ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:detect_odr_violation=0")
fi
twobp_use_venv
mode_args=()
# asan: the test tree's own code with ASan only (TWOBP_SANITIZE_TESTS, CMakeLists.txt), the library with both.
[[ "$mode" == asan ]] && mode_args=(-DTWOBP_BUILD_BENCHMARKS=OFF -DTWOBP_WITH_NCCL=OFF -DTWOBP_SANITIZE_TESTS=address)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
      "${mode_args[@]}" \
      -DPython3_EXECUTABLE="$TWOBP_VENV/bin/python" \
      "-DTWOBP_SANITIZE=$sanitize" "${mpi_flags[@]}" "${launcher[@]}" ${TWOBP_CMAKE_ARGS:-}

write_suppressions() {
  mkdir -p "$supp_dir"
  # Keep every entry narrow (a library or a function, never a whole category) and say why it is harmless.
  cat >"$supp_dir/ubsan.supp" <<'SUPP'
# UBSan: no suppressions needed (LibTorch is not instrumented, so only our code and inlined headers are checked).
SUPP
  cat >"$supp_dir/lsan.supp" <<'SUPP'
# Open MPI, for a process that initialises MPI without mpiexec (the ranks mpiexec starts check no leaks, see
# TWOBP_MPIEXEC_FLAGS above): MPI_Init's one-time allocations and those of its MCA plugins are never freed, and the
# plugins are dlclose()d before LSan looks; what stays attributable (with fast_unwind_on_malloc=0) is the Open MPI
# library (or the libevent progress thread) that called into them.
leak:libopen-pal.so
leak:libopen-rte.so
leak:libmpi.so
# Open MPI's progress thread runs a libevent loop whose callbacks live in the dlclose()d plugins.
leak:libevent_core
SUPP
  cat >"$supp_dir/tsan.supp" <<'SUPP'
# TSan: no suppressions needed for the Local transport and pipeline tests (OMP_NUM_THREADS=1, see below).
SUPP
}
write_suppressions

# Open MPI forwards the environment to the ranks it starts on this host, so these reach MPI tests too.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp_dir/ubsan.supp"
# -LE timing: tests whose verdict compares measured throughputs (the planner check) mean nothing under a
# sanitizer, which slows twobp's code and not LibTorch's kernels; their code paths run in the bench smoke tests.
ctest_args=(--output-on-failure --test-dir "$build_dir" -LE timing -j "${TWOBP_TEST_JOBS:-$(twobp_cores)}")
if [[ "$mode" == asan ]]; then
  cmake --build "$build_dir" -j "$jobs" --target twobp_sanitize_targets
  ctest_args+=(-L sanitize)
  export TWOBP_TEST_SCALE=reduced
  # detect_leaks: on in every process but MPI ranks (above); lsan.supp only excuses Open MPI (LibTorch's own
  #   start-up state is reachable).
  # protect_shadow_gap=0: the CUDA driver (GPU machines, LibTorch's CUDA build) maps memory in ASan's shadow
  #   gap and fails to initialise otherwise; harmless on CPU-only machines.
  # detect_odr_violation=0: LibTorch and our binaries both carry fmt's header-only globals.
  export ASAN_OPTIONS="detect_leaks=1:protect_shadow_gap=0:detect_odr_violation=0:\
strict_init_order=1:check_initialization_order=1"
  export LSAN_OPTIONS="suppressions=$supp_dir/lsan.supp:print_suppressions=0"
  # install_consumer builds a program against the installed (instrumented) static libtwobp: it must be
  # instrumented too, or its link fails on __asan_* symbols. CMake reads CXXFLAGS/LDFLAGS at its first configure.
  export CXXFLAGS="-fsanitize=$sanitize -fno-omit-frame-pointer" LDFLAGS="-fsanitize=$sanitize"
else
  targets=(transport_local_test pipeline_test pipeline_split_classes_test executor_test launch_test data_parallel_test
           memory_test memory_limit_test mixed_precision_test)
  cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"
  # second_deadlock_stack: both stacks of a lock-order inversion. OMP_NUM_THREADS=1: LibTorch's intra-op pool
  # is libgomp, whose barriers TSan cannot see (every parallel_for would be reported); the ranks are our threads.
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:history_size=4:suppressions=$supp_dir/tsan.supp"
  export OMP_NUM_THREADS=1
  ctest_args+=(-R "^($(IFS='|'; echo "${targets[*]}"))\$")
fi

start=$SECONDS
status=0
ctest "${ctest_args[@]}" "$@" || status=$?
echo "sanitize.sh $mode: ctest took $((SECONDS - start)) s, exit status $status"
exit $status
