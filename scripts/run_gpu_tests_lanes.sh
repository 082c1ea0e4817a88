#!/usr/bin/env bash
# The GPU suite in lanes that run at once. 4+ GPUs: files that need one GPU alternate between GPU 0 and GPU 1,
# two-GPU files run on GPUs 2,3, and the four-GPU files run last on GPUs 0-3. 2-3 GPUs: the one-GPU files
# alternate between GPU 0 and GPU 1, then the two-GPU files run on 0,1 (the four-GPU files skip). Each file is its
# own pytest run (scripts/run_gpu_tests.sh), so a file cut off by its time limit still leaves the others'
# results; rendezvous ports are free ones (the tests launch torchrun --standalone), so lanes do not collide.
# With one GPU this is scripts/run_gpu_tests.sh. Ends with one line per file and a total.
#   bash scripts/run_gpu_tests_lanes.sh                 # logs in $LOG_DIR (default /tmp/gpu_lanes)
#   FILE_TIMEOUT=300 bash scripts/run_gpu_tests_lanes.sh -x
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -lt 2 ]; then
  exec bash scripts/run_gpu_tests.sh "$@"
fi
LOG_DIR=${LOG_DIR:-/tmp/gpu_lanes}; FILE_TIMEOUT=${FILE_TIMEOUT:-600}
mkdir -p "$LOG_DIR"
one=(); two=(); four=()
for f in tests/gpu/test_*.py; do
  if grep -q "device_count() < 4" "$f"; then four+=("$f")
  elif grep -q "device_count() < 2" "$f"; then two+=("$f")
  else one+=("$f"); fi
done
run_lane() {  # run_lane DEVICES FILE... : each file in turn on DEVICES
  local devices=$1; shift
  for f in "$@"; do
    local log="$LOG_DIR/$(basename "$f" .py).log"
    CUDA_VISIBLE_DEVICES=$devices timeout -k 10 "$FILE_TIMEOUT" bash scripts/run_gpu_tests.sh "$f" "${EXTRA[@]}" \
      > "$log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "GPU tests: cut off after ${FILE_TIMEOUT} s (FILE_TIMEOUT)" >> "$log"
  done
}
EXTRA=("$@")
lane0=(); lane1=()
for i in "${!one[@]}"; do
  if (( i % 2 == 0 )); then lane0+=("${one[$i]}"); else lane1+=("${one[$i]}"); fi
done
start=$(date +%s)
if [ "$gpus" -ge 4 ]; then
  run_lane 0 "${lane0[@]}" & run_lane 1 "${lane1[@]}" & run_lane 2,3 "${two[@]}" &
  wait
  [ ${#four[@]} -gt 0 ] && run_lane 0,1,2,3 "${four[@]}"
else
  run_lane 0 "${lane0[@]}" & run_lane 1 "${lane1[@]}" &
  wait
  run_lane 0,1 "${two[@]}"
  [ ${#four[@]} -gt 0 ] && run_lane 0,1 "${four[@]}"  # they skip themselves: a summary line each
fi
rc=0
for f in "${one[@]}" "${two[@]}" "${four[@]}"; do
  line=$(grep -E "^GPU tests:" "$LOG_DIR/$(basename "$f" .py).log" | tail -1)
  printf '%-48s %s\n' "$(basename "$f")" "${line:-GPU tests: no summary (see the log)}"
  [[ "$line" == *" 0 failed,"*" 0 errors"* ]] || rc=1
done
echo "GPU lanes: ${#one[@]} one-GPU, ${#two[@]} two-GPU, ${#four[@]} four-GPU files on $gpus GPUs in $(( $(date +%s) - start )) s; logs in $LOG_DIR"
exit $rc
