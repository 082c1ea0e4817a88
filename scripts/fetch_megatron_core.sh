#!/usr/bin/env bash
# Unpack Megatron Core 0.19.2 (its wheel, not installed: it must not shadow this checkout's `megatron`) for the
# tests that run Megatron itself in a subprocess (tests/functional/test_megatron_checkpoints.py,
# test_megatron_training_checkpoints.py). Those tests are skipped without it.
#   scripts/fetch_megatron_core.sh [DIR]      # default /tmp/mcore_site; then: MCORE_SITE=DIR pytest ...
set -euo pipefail
SITE="${1:-${MCORE_SITE:-/tmp/mcore_site}}"
if [ -d "$SITE/megatron_core-0.19.2.dist-info" ]; then
    echo "Megatron Core 0.19.2 already unpacked at $SITE"
    exit 0
fi
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
# The wheel targets Python >= 3.12; its Python files also run on 3.11 once unpacked (no compiled part is used).
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" megatron-core==0.19.2
python -m zipfile -e "$WHEELS"/megatron_core-0.19.2-*.whl "$SITE"
python -m pip install --no-deps --target "$SITE" psutil  # its torch_dist save imports psutil
echo "Megatron Core 0.19.2 unpacked at $SITE; run the tests with MCORE_SITE=$SITE"
