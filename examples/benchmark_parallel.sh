#!/bin/bash
# Multi-GPU throughput of the gpt-1.3b config (tools/benchmark.py) under TP, PP and DP layouts on one
# node of 4 GPUs, against 1 GPU. About 2-3 minutes per phase on 4 H200s (FAST=--fast adds the compile warm-up).
#   OUT=/tmp/bench bash examples/benchmark_parallel.sh [tp] [dp] [pp] [tp-overlap]
# Results: one JSON line per run in $OUT/results.jsonl, logs in $OUT; a markdown table at the end.
set -u
OUT=${OUT:-/tmp/bench}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RESULTS=$OUT/results.jsonl
CONFIG=${CONFIG:-gpt-1.3b}
FAST=${FAST:-}   # FAST=--fast adds the compiled layers and chunked loss
ITERS=${ITERS:-"--iters 8 --warmup 3"}
run() {  # run <label> <gpus> <timeout s> <benchmark args...> [-- <Megatron flags>]
  local name=$1 n=$2 limit=$3; shift 3
  echo "=== $name on $n GPU(s): tools/benchmark.py $*"
  timeout "$limit" torchrun --nproc-per-node "$n" tools/benchmark.py --results "$RESULTS" --label "$name" \
    --config "$CONFIG" $FAST $ITERS "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -E "benchmark result|Error" "$OUT/$name.log" | tail -2
}
for phase in "${@:-tp}"; do
case "$phase" in
  tp)  # tensor parallel at a fixed per-model batch: mbs 4, gbs 4
    run 1gpu 1 150
    run tp2-sp 2 150 -- --tensor-model-parallel-size 2 --sequence-parallel
    run tp4-sp 4 150 -- --tensor-model-parallel-size 4 --sequence-parallel
    ;;
  pp)  # pipeline: 8 micro-batches of 4; bubble (p-1)/(m+p-1) = 1/9 at PP=2
    run 1gpu-gbs32 1 200 -- --global-batch-size 32
    run pp2-gbs32 2 200 -- --global-batch-size 32 --pipeline-model-parallel-size 2
    run tp2-pp2-sp-gbs32 4 200 -- --global-batch-size 32 --pipeline-model-parallel-size 2 \
      --tensor-model-parallel-size 2 --sequence-parallel
    ;;
  dp)  # data parallel: 4 ranks x mbs 4 = gbs 16; 1 GPU reference is the tp phase's 1gpu run
    run dp4 4 150 -- --global-batch-size 16
    run dp4-overlap 4 150 -- --global-batch-size 16 --overlap-grad-reduce
    run dp4-distopt-overlap 4 150 -- --global-batch-size 16 --overlap-grad-reduce \
      --use-distributed-optimizer --overlap-param-gather
    ;;
  tp-overlap)  # Llama-3-8B shapes, 8 of 32 layers, gbs 4: TP=2 + SP with and without --tp-comm-overlap (2 GPUs)
    L8="--num-layers 8 --global-batch-size 4 --use-distributed-optimizer"
    CONFIG=llama3-8b run llama8-1gpu 1 400 -- $L8
    CONFIG=llama3-8b run llama8-tp2-sp 2 400 -- $L8 --tensor-model-parallel-size 2 --sequence-parallel
    CONFIG=llama3-8b run llama8-tp2-sp-overlap 2 400 -- $L8 --tensor-model-parallel-size 2 --sequence-parallel \
      --tp-comm-overlap
    torchrun --nproc-per-node 2 tools/bench_tp_overlap.py > "$OUT/tp-overlap-layers.log" 2>&1  # one layer's linears
    grep -E "^TP=|Error" "$OUT/tp-overlap-layers.log"
    ;;
esac
done
python tools/benchmark.py --table "$RESULTS"
