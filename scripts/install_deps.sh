#!/usr/bin/env bash
# Installs the Python dependencies into the current interpreter. An already installed torch (>= 2.4,
# CPU or CUDA) is kept; without one, the pinned CPU build from constraints-ci.txt is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))" 2>/dev/null; then
  $PY -m pip install -q -c constraints-ci.txt torch
fi
# Everything else, without touching the torch that is now present.
$PY -m pip install -q $(grep -v -E '^\s*(#|$|torch)' requirements.txt requirements-test.txt | sed 's/^[^:]*://; s/#.*//')
