#!/usr/bin/env bash
# The test command (README Quick start, .ci/run): install dependencies, then the whole CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
PY=${PYTHON:-python3}
# Two workers: most tests wait on subprocesses, gloo or I/O, so two share the 2 CI cores well. --dist loadfile
# keeps each file on one worker, so a module-scoped fixture (a reference run, an imported HF model) is built
# once instead of once per worker: 9 min 45 s against 12 min 53 s for the whole suite on 2 cores.
exec $PY -m pytest -x -q -n ${TEST_WORKERS:-2} --dist loadfile "$@"
