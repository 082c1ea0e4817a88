#!/usr/bin/env bash
# The GPU suite: all of tests/gpu on every GPU this machine shows (CUDA_VISIBLE_DEVICES narrows it), one
# pytest process; tests that need more GPUs than there are skip and say so. Extra arguments go to pytest
# (-x, -k overlap, -s). Ends with one line: passed, failed, skipped, errors and the GPUs they ran on.
#   bash scripts/run_gpu_tests.sh            # on the device machine, from anywhere in the checkout
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# NVLink multicast stays off in NCCL, torch's symmetric memory and NVSHMEM: a program that uses it can
# take a shared host's GPUs out of service. The tests' own subprocesses (torchrun) inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
read -r gpus name < <($PY -c "import torch; n = torch.cuda.device_count(); \
print(n, torch.cuda.get_device_name(0).replace(' ', '_') if n else 'none')" 2>/dev/null || echo "0 none")
echo "run_gpu_tests: ${gpus} GPU(s) (${name//_/ }); torch $($PY -c 'import torch; print(torch.__version__)')"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pytest tests/gpu -v -rs -p no:cacheprovider --junitxml="$tmp/junit.xml" "$@"
rc=$?
$PY - "$tmp/junit.xml" "$gpus" "${name//_/ }" "$rc" <<'PY'
import sys
import xml.etree.ElementTree as ET

path, gpus, name, rc = sys.argv[1:]
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError):
    print(f"GPU tests: no results (pytest exit {rc}) on {gpus} GPU(s) ({name})")
    sys.exit(0)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
print(f"GPU tests: {passed} passed, {count['failures']} failed, {count['skipped']} skipped, "
      f"{count['errors']} errors on {gpus} GPU(s) ({name}); pytest exit {rc}")
PY
exit $rc
