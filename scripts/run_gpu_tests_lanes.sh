#!/usr/bin/env bash
# The GPU suite in lanes that run at once, each file its own pytest run (scripts/run_gpu_tests.sh), so a file cut
# off by its time limit still leaves the others' results. Files are taken from shared queues, slowest known first,
# by every GPU (one-GPU files) and every pair of GPUs (two-GPU files) at once; the four-GPU files run last on GPUs
# 0-3 (on fewer GPUs they skip, a summary line each). Rendezvous ports are free
# ones (the tests launch torchrun --standalone), so lanes do not collide. With one GPU this is
# scripts/run_gpu_tests.sh. Ends with one line per file (its result and seconds) and a total, also when stopped
# from outside (SIGTERM, INT): the running files are killed with their processes, and named with their test.
#   bash scripts/run_gpu_tests_lanes.sh                 # logs in $LOG_DIR (default /tmp/gpu_lanes)
#   FILE_TIMEOUT=300 bash scripts/run_gpu_tests_lanes.sh -x
#   CLASSES="two four" bash scripts/run_gpu_tests_lanes.sh   # only the multi-GPU files
#   FILES="test_profiler_gpu test_hybrid_cp_gpu" bash scripts/run_gpu_tests_lanes.sh   # only these files
#   LANES_PER_GPU=2 bash scripts/run_gpu_tests_lanes.sh      # two files at once on every GPU / pair
#   BUDGET_S=560 bash scripts/run_gpu_tests_lanes.sh          # start no file that cannot end within 560 s
# Each file that ran to its end adds "NAME SECONDS" to $LOG_DIR/durations.txt (tests/gpu/durations.txt's format).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -lt 2 ]; then
  exec bash scripts/run_gpu_tests.sh "$@"
fi
LOG_DIR=${LOG_DIR:-/tmp/gpu_lanes}; FILE_TIMEOUT=${FILE_TIMEOUT:-600}
# BUDGET_S: the seconds this call may spend (a device call's limit less a margin); a file whose expected time
# (tests/gpu/durations.txt, measured alone on its devices, else DEFAULT_FILE_S) no longer fits is not started and
# says so in the summary. 0: no budget.
BUDGET_S=${BUDGET_S:-0}; DEFAULT_FILE_S=${DEFAULT_FILE_S:-120}
mkdir -p "$LOG_DIR"
# Measured slowest first (Triton autotuning, compiled graphs, many torchrun launches), so no lane starts one late.
SLOW="test_ssm_gpu test_hybrid_generation_gpu test_muon_gpu test_vlm_gpu test_qwen25_vl_gpu test_sft_gpu
 test_fast_path_gpu test_fp8_gpu test_moe_gpu test_context_parallel_gpu test_tp_comm_overlap_gpu test_moe_overlap_gpu
 test_fault_drills_gpu test_pipeline_overlap_gpu"
ordered=()
for s in $SLOW; do [ -e "tests/gpu/$s.py" ] && ordered+=("tests/gpu/$s.py"); done
for f in tests/gpu/test_*.py; do [[ " ${ordered[*]} " == *" $f "* ]] || ordered+=("$f"); done
if [ -n "${FILES:-}" ]; then  # only the files named (without .py), e.g. the ones a cut-off call did not finish
  kept=()
  for f in "${ordered[@]}"; do [[ " $FILES " == *" $(basename "$f" .py) "* ]] && kept+=("$f"); done
  for name in $FILES; do [ -e "tests/gpu/$name.py" ] || { echo "FILES: no tests/gpu/$name.py" >&2; exit 2; }; done
  ordered=("${kept[@]}")
fi
# Entries are FILE|MARKERS: a file whose four-GPU tests are marked `four_gpus` among two-GPU ones runs twice, the
# rest on a pair with the two-GPU files (-m "not four_gpus") and the marked tests on four GPUs at the end, so its
# two-GPU tests do not hold four GPUs.
one=(); two=(); four=()
for f in "${ordered[@]}"; do
  if grep -q "device_count() < 4" "$f"; then
    if grep -q "device_count() < 2" "$f" && grep -qE "mark\.four_gpus|^def four_gpus" "$f"; then
      two+=("$f|not four_gpus"); four+=("$f|four_gpus")
    else four+=("$f|"); fi
  elif grep -q "device_count() < 2" "$f"; then two+=("$f|")
  else one+=("$f|"); fi
done
EXTRA=("$@")
log_of() {  # log_of ENTRY: the entry's log file
  local name; name=$(basename "${1%%|*}" .py)
  [ "${1#*|}" = "four_gpus" ] && name="$name.four"
  echo "$LOG_DIR/$name.log"
}
expected_s() {  # expected_s ENTRY: the seconds tests/gpu/durations.txt gives the entry, else DEFAULT_FILE_S
  local name; name=$(basename "$(log_of "$1")" .log)
  [ -f tests/gpu/durations.txt ] || { echo "$DEFAULT_FILE_S"; return; }
  awk -v n="$name" -v d="$DEFAULT_FILE_S" '$1 == n {v = $2} END {print (v == "" ? d : v)}' tests/gpu/durations.txt
}
run_file() {  # run_file DEVICES ENTRY
  local path=${2%%|*} markers=${2#*|} log t0=$SECONDS rc; log=$(log_of "$2")
  local select=(); [ -n "$markers" ] && select=(-m "$markers")
  if (( BUDGET_S > 0 )); then  # a file that cannot end within the budget is not started: no device time lost on it
    local need left; need=$(expected_s "$2"); left=$(( BUDGET_S - ($(date +%s) - start) ))
    if (( need > left )); then
      echo "GPU tests: not started (~$need s expected, $left s left of BUDGET_S=$BUDGET_S)" > "$log"; return
    fi
  fi
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$FILE_TIMEOUT" bash scripts/run_gpu_tests.sh "$path" "${select[@]}" "${EXTRA[@]}" \
    > "$log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && echo "GPU tests: cut off after ${FILE_TIMEOUT} s (FILE_TIMEOUT)" >> "$log"
  echo "GPU lanes: $((SECONDS - t0)) s on GPU(s) $1" >> "$log"
  # The seconds of each file that ran to its end, in tests/gpu/durations.txt's format, to refresh that table.
  [ $rc -ne 124 ] && echo "$(basename "$log" .log) $((SECONDS - t0))" >> "$LOG_DIR/durations.txt"
}
pop() {  # pop QUEUE: print and remove its first line, under a lock shared by the lanes
  ( flock 9; head -n 1 "$1"; sed -i 1d "$1" ) 9> "$1.lock"
}
drain() {  # drain QUEUE DEVICES: run files from QUEUE on DEVICES until it is empty
  local f
  while f=$(pop "$1"); [ -n "$f" ]; do run_file "$2" "$f"; done
}
# One queue per class. Each pair of GPUs works both queues and steals the other's work when its own is done: even
# pairs take one-GPU files first (a lane per GPU), odd pairs two-GPU files first, so on 4+ GPUs the two-GPU files
# start at once instead of after every one-GPU file. CLASSES="two four" (or "one") runs only those classes, to split
# the suite over several device calls.
CLASSES=${CLASSES:-one two four}
q1=$(mktemp); q2=$(mktemp); trap 'rm -f "$q1" "$q1.lock" "$q2" "$q2.lock"' EXIT
[[ " $CLASSES " == *" one "* ]] && printf '%s\n' "${one[@]}" > "$q1"
[[ " $CLASSES " == *" two "* ]] && [ ${#two[@]} -gt 0 ] && printf '%s\n' "${two[@]}" > "$q2"
start=$(date +%s)
summary() {  # one line per file that ran or was running (its seconds; a stopped one: the test it was in), a total
  local rc=0 f log line label took current
  for f in "${one[@]}" "${two[@]}" "${four[@]}"; do
    log=$(log_of "$f")
    [ -e "$log" ] || continue  # a class not asked for, or not reached
    line=$(grep -E "^GPU tests:" "$log" | tail -1)
    took=$(sed -n 's/^GPU lanes: \([0-9]*\) s on.*/ (\1 s)/p' "$log" | tail -1)
    if [ -z "$line" ]; then
      current=$(grep -oE "^tests/gpu/[^ ]+::[^ ]+" "$log" | tail -1)
      line="GPU tests: stopped before the end${current:+, in ${current#tests/gpu/}}"
    fi
    label=$(basename "${f%%|*}"); [ -n "${f#*|}" ] && label="$label (-m ${f#*|})"
    printf '%-48s %s%s\n' "$label" "$line" "$took"
    [[ "$line" == *" 0 failed,"*" 0 errors"* ]] || rc=1
  done
  echo "GPU lanes: ${#one[@]} one-GPU, ${#two[@]} two-GPU, ${#four[@]} four-GPU files on $gpus GPUs in $(( $(date +%s) - start )) s; logs in $LOG_DIR"
  return $rc
}
kill_tree() {  # kill_tree PID: the process and everything it started (pytest, torchrun and their ranks hold GPUs)
  local child
  for child in $(children "$1"); do kill_tree "$child"; done
  kill -TERM "$1" 2>/dev/null
}
children() { pgrep -P "$1" 2>/dev/null || ps -o pid= --ppid "$1" 2>/dev/null; }
# Stopped from outside (a device call's time limit, Ctrl-C): the lanes' processes are taken down, so none keeps
# its GPUs, and the summary still says what passed and where each unfinished file stood.
stopped() {
  trap - TERM INT
  local child
  for child in $(children $$); do kill_tree "$child"; done
  wait
  echo "GPU lanes: stopped from outside"
  summary
  exit 124
}
trap stopped TERM INT
ones_on() { drain "$q1" "$1" & drain "$q1" "$2" & wait; }
# LANES_PER_GPU=2 starts two of these lanes on every GPU and pair: the files are mostly launch-, compile- and
# host-bound small models, so two at once share a GPU (ample memory on 80-141 GB cards) for ~1.6x the throughput.
# Timings printed by the tests are then not comparable with a run of one lane per GPU.
LANES_PER_GPU=${LANES_PER_GPU:-1}
for ((k = 0; k < LANES_PER_GPU; k++)); do
  for ((g = 0; g + 1 < gpus; g += 2)); do
    if (( (g / 2 + k) % 2 == 0 )); then ( ones_on $g $((g + 1)); drain "$q2" "$g,$((g + 1))" ) &
    else ( drain "$q2" "$g,$((g + 1))"; ones_on $g $((g + 1)) ) &
    fi
  done
  (( gpus % 2 == 1 )) && drain "$q1" $((gpus - 1)) &
done
wait
all=$(seq -s, 0 $((gpus < 4 ? gpus - 1 : 3)))
if [[ " $CLASSES " == *" four "* ]]; then
  for f in "${four[@]}"; do run_file "$all" "$f" & wait $!; done  # in the background: a stop is handled at once
fi
summary
exit $?
