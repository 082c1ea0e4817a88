#!/usr/bin/env bash
# The test command (README Quick start, .ci/run): install dependencies, then the whole CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
PY=${PYTHON:-python3}
# Two workers: most tests wait on subprocesses, gloo or I/O, so two share the 2 CI cores well.
exec $PY -m pytest -x -q -n ${TEST_WORKERS:-2} "$@"
