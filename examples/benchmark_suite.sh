#!/bin/bash
# One-GPU benchmark suite: matmul ceiling, then the named configs eager vs fast path, a recompute run
# and a profile. Results: one JSON line per run in $RESULTS, logs in $LOGDIR; a table at the end.
#   OUT=/tmp/bench bash examples/benchmark_suite.sh [phase]
set -u
OUT=${OUT:-/tmp/bench}; mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl; LOGDIR=$OUT
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
PHASE=${1:-main}
bench() {  # bench <log name> <timeout s> <benchmark args...>
  local name=$1 limit=$2; shift 2
  echo "=== $name: python tools/benchmark.py $*"
  timeout "$limit" python tools/benchmark.py --results "$RESULTS" --label "$name" "$@" > "$LOGDIR/$name.log" 2>&1
  echo "exit $?"; grep -E "benchmark result|Estimate|Error|error" "$LOGDIR/$name.log" | tail -4
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
python - <<'PY'
import torch, triton
from triton.testing import do_bench
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
n = 8192
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
print(f"bf16 matmul {n}^3 ceiling: {2 * n**3 / ms / 1e9:.0f} TFLOP/s")
PY
if [ "$PHASE" = main ]; then
  bench gpt-1.3b-eager 150 --config gpt-1.3b --iters 10 --warmup 3
  bench gpt-1.3b-fast 240 --config gpt-1.3b --fast --iters 20 --warmup 5 --profile 2
  bench gpt-1.3b-compile-only 150 --config gpt-1.3b --iters 15 --warmup 4 -- --torch-compile
  bench gpt-125m-fast 150 --config gpt-125m --fast --iters 20 --warmup 5
  bench llama3-8b-fast 200 --config llama3-8b --fast --iters 10 --warmup 4
  bench gpt-1.3b-fast-recompute-full 150 --config gpt-1.3b --fast --iters 10 --warmup 4 -- \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  bench gpt-1.3b-fast-recompute-selective 150 --config gpt-1.3b --fast --iters 10 --warmup 4 -- \
    --recompute-activations
  bench gpt-1.3b-fast-flash 120 --config gpt-1.3b --fast --iters 15 --warmup 4 -- --attention-backend flash
  bench gpt-125m-eager 100 --config gpt-125m --iters 15 --warmup 3
  timeout 120 python -m pytest -q tests/gpu > "$LOGDIR/pytest_gpu.log" 2>&1; echo "gpu tests exit $?"
  tail -3 "$LOGDIR/pytest_gpu.log"
fi
if [ "$PHASE" = gc ]; then
  bench gpt-1.3b-fast-nogc 240 --config gpt-1.3b --fast --iters 30 --warmup 5 --no-gc
  bench gpt-1.3b-eager-nogc 120 --config gpt-1.3b --iters 20 --warmup 3 --no-gc
fi
if [ "$PHASE" = graphs ]; then  # whole-iteration CUDA graphs (--cuda-graph-impl full_iteration)
  timeout 240 python -m pytest -q tests/gpu > "$LOGDIR/pytest_gpu.log" 2>&1; echo "gpu tests exit $?"
  tail -3 "$LOGDIR/pytest_gpu.log"
  G="--cuda-graph-impl full_iteration"
  bench gpt-1.3b-eager 150 --config gpt-1.3b --iters 15 --warmup 3
  bench gpt-1.3b-eager-graph 150 --config gpt-1.3b --iters 15 --warmup 5 -- $G
  bench gpt-1.3b-fast 200 --config gpt-1.3b --fast --iters 15 --warmup 5
  bench gpt-1.3b-fast-graph 240 --config gpt-1.3b --fast --iters 20 --warmup 5 --profile 2 -- $G
fi
if [ "$PHASE" = graphs2 ]; then
  G="--cuda-graph-impl full_iteration"
  bench gpt-125m-fast-graph 150 --config gpt-125m --fast --iters 20 --warmup 5 -- $G
  bench llama3-8b-fast-graph 200 --config llama3-8b --fast --iters 10 --warmup 5 -- $G
  bench gpt-1.3b-fast-graph-fp8 200 --config gpt-1.3b --fast --iters 15 --warmup 5 -- $G --fp8-format hybrid
fi
if [ "$PHASE" = graphs3 ]; then  # FP8 on the other shapes, and the full kernel list of the bf16 step
  G="--cuda-graph-impl full_iteration"
  bench gpt-125m-fast-graph-fp8 150 --config gpt-125m --fast --iters 20 --warmup 5 -- $G --fp8-format hybrid
  bench llama3-8b-fast-graph-fp8 200 --config llama3-8b --fast --iters 10 --warmup 5 -- $G --fp8-format hybrid
  bench gpt-1.3b-fast-graph-profile 200 --config gpt-1.3b --fast --iters 10 --warmup 5 --profile 1 \
    --profile-rows 80 -- $G
fi
python tools/benchmark.py --table "$RESULTS"
