#!/usr/bin/env bash
# Installs what is missing, builds into build/ and trains the tiny LLaMa-like model on CPU as a 2-stage pipeline
# (two ranks as threads in this process, 1F1B with 2BP). Extra arguments go to the example, e.g. --no-2bp.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
twobp_setup
twobp_build llama_pipeline  # the library and the example only, not the tests
exec "${TWOBP_BUILD_DIR:-build}/examples/llama_pipeline" --model tiny --ranks 2 --schedule 1f1b --2bp \
  --steps 150 "$@"
