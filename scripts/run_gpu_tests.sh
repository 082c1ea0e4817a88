#!/usr/bin/env bash
# The GPU suite: all of tests/gpu on every GPU this machine shows (CUDA_VISIBLE_DEVICES narrows it), one
# pytest process; tests that need more GPUs than there are skip and say so. Extra arguments go to pytest
# (-x, -k overlap, -s); test paths among them replace tests/gpu, to split the suite where one command
# may run for a limited time (the whole of it took more than 8 minutes on two H200s). Ends with one line:
# passed, failed, skipped, errors and the GPUs they ran on; the slowest tests are listed above it.
#   bash scripts/run_gpu_tests.sh                                        # everything
#   bash scripts/run_gpu_tests.sh tests/gpu/test_tp_comm_overlap_gpu.py  # one file
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
targets=tests/gpu
for arg in "$@"; do
  [[ "$arg" == tests/* && -e "${arg%%::*}" ]] && targets=  # the caller named the tests
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pytest $targets -v -rs --durations=15 -p no:cacheprovider --junitxml="$tmp/junit.xml" "$@"
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
