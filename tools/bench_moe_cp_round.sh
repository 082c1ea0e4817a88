#!/bin/bash
# One 2-GPU call: MoE rows (ours and Megatron Core side by side on separate GPUs for the 1-GPU rows), EP=2
# rows, CP=1 vs CP=2 at 32k, packed-document attention, the ring overlap check, GPU tests. Logs under $OUT.
# Needs ../shared/megatron_reference copied to .mref/ with the megatron-core wheel (its README); run from the
# repository root on a 2-GPU machine: bash tools/bench_moe_cp_round.sh
set -u
R=$(pwd)/.mref; OUT=${OUT:-/tmp/mref}; mkdir -p $OUT
source $R/configs.sh
[ -d /tmp/mref_site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mref_site $R/whl/megatron_core-*.whl
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
ours() { # name ngpu port flags...
  local name=$1 n=$2 port=$3; shift 3
  timeout ${TMO:-150} torchrun --nproc_per_node $n --master_port $port pretrain_gpt.py "$@" > $OUT/ours_$name.log 2>&1
}
mcore() { local name=$1 port=$2; shift 2
  BENCH_SDPA=1 PYTHONPATH=/tmp/mref_site timeout ${TMO:-150} torchrun --nproc_per_node 1 --master_port $port $R/mcore_driver.py "$@" $MCORE_ONLY > $OUT/mcore_$name.log 2>&1
}
it="--train-iters 20"
# Phase A: 1-GPU MoE rows, ours on GPU 0 and Megatron on GPU 1 at the same time.
( export CUDA_VISIBLE_DEVICES=0; ours mix_1gpu 1 29501 $MOE_MIXTRAL $it; ours fine_1gpu 1 29502 $MOE_FINE $it ) &
( export CUDA_VISIBLE_DEVICES=1; mcore mix_1gpu 29503 $MOE_MIXTRAL $it; mcore fine_1gpu 29504 $MOE_FINE $it ) &
wait; el phase A
for x in mix_1gpu:8 fine_1gpu:8; do n=${x%%:*}; g=${x##*:}
  python3 $R/res.py ours_$n $g 1 $OUT/ours_$n.log 4096 0; python3 $R/res.py megatron_$n $g 1 $OUT/mcore_$n.log 4096 0; done
# Phase B: EP=2 rows (ours).
ours mix_ep2 2 29505 $MOE_MIXTRAL $it --expert-model-parallel-size 2 --global-batch-size 16
python3 $R/res.py ours_mix_ep2 16 2 $OUT/ours_mix_ep2.log 4096 0
ours fine_ep2 2 29506 $MOE_FINE $it --expert-model-parallel-size 2 --global-batch-size 16
python3 $R/res.py ours_fine_ep2 16 2 $OUT/ours_fine_ep2.log 4096 0; el phase B
# Phase C: context parallelism, Llama-3-8B layers (8), seq 32768, full recompute, gbs 2.
CPF="$LLAMA8B --num-layers 8 --seq-length 32768 --max-position-embeddings 32768 --global-batch-size 2 --train-iters 14 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
CUDA_VISIBLE_DEVICES=0 ours cp1_32k 1 29507 $CPF
python3 $R/res.py ours_cp1_32k 2 1 $OUT/ours_cp1_32k.log 32768 0
ours cp2_32k 2 29508 $CPF --context-parallel-size 2 --cp-comm-type p2p
python3 $R/res.py ours_cp2_32k 2 2 $OUT/ours_cp2_32k.log 32768 0; el phase C
if [ $(( $(date +%s) - T0 )) -lt 330 ]; then
  TMO=110 ours cp2_128k 2 29510 $CPF --seq-length 131072 --max-position-embeddings 131072 --train-iters 3 --context-parallel-size 2 --cp-comm-type p2p
  grep -E "\] iteration|rror|memory" $OUT/ours_cp2_128k.log | cut -c1-260 | tail -4; el 128k
fi
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 tools/bench_long_context_attention.py documents --seq 8192 --doc-len 1024 2>&1 | tail -8
timeout 60 torchrun --nproc-per-node 2 --master_port 29509 tools/bench_long_context_attention.py ring --seq 32768 --comm p2p 2>&1 | tail -6; el benches
# Phase D: GPU tests.
timeout ${TTESTS:-150} python3 -m pytest -q -x tests/gpu/test_moe_gpu.py tests/gpu/test_context_parallel_gpu.py tests/gpu/test_deterministic_gpu.py tests/gpu/test_full_cuda_graph_gpu.py::test_full_iteration_graph_with_default_data_flags 2>&1 | tail -15; el tests
grep -h "Theoretical memory\|max allocated\|mem-max-allocated" $OUT/ours_cp1_32k.log $OUT/ours_cp2_32k.log | head -4
