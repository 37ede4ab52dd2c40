#!/usr/bin/env bash
# Installs what is missing, builds into build/ and runs the whole test suite (ctest: unit, parity, mpi, bench;
# gpu tests skip themselves without a GPU) on every core (TWOBP_TEST_JOBS, default nproc; tests that start several
# processes claim several with ctest's PROCESSORS). Extra arguments go to ctest, e.g. scripts/test.sh -L parity
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
twobp_setup
twobp_build
ctest --test-dir "${TWOBP_BUILD_DIR:-build}" --output-on-failure -j "${TWOBP_TEST_JOBS:-$(nproc)}" "$@"
