#!/usr/bin/env bash
# Installs what is missing, builds into build/ and runs the whole test suite (ctest: unit, parity, mpi, bench;
# gpu tests skip themselves without a GPU) on every core (TWOBP_TEST_JOBS, default the core count; tests that start several
# processes claim several with ctest's PROCESSORS). Extra arguments go to ctest, e.g. scripts/test.sh -L parity
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
twobp_setup
twobp_build
# One intra-op thread per test process unless set: ctest already runs one test per core, and tests that each also
# spread their kernels over every core oversubscribe them (measured: six heavy tests 17 % faster at -j2 this way).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ctest --test-dir "${TWOBP_BUILD_DIR:-build}" --output-on-failure -j "${TWOBP_TEST_JOBS:-$(twobp_cores)}" "$@"
