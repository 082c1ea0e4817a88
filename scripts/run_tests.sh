#!/usr/bin/env bash
# The test command (README Quick start, .ci/run): install dependencies, then the whole CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
PY=${PYTHON:-python3}
exec $PY -m pytest -x -q "$@"
