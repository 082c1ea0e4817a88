#!/bin/bash
# One 2-GPU call: context parallelism on Llama-3-8B layers: the ring's efficiency and exposed communication,
# CP=1 vs CP=2 at seq 32k (8 layers, full recompute), the CP=2 GPU test. Logs under $OUT. Needs
# ../shared/megatron_reference copied to .mref/ (for configs.sh and res.py); run from the repository root.
set -u
R=$(pwd)/.mref; OUT=${OUT:-/tmp/r5}; mkdir -p $OUT
source $R/configs.sh
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/steps.txt; }
timeout 60 torchrun --nproc-per-node 2 --master_port 29903 tools/bench_long_context_attention.py ring --seq 32768 --comm p2p > $OUT/ring.txt 2>&1; el ring; grep -v Warn $OUT/ring.txt | tail -3
CPF="$LLAMA8B --num-layers 8 --seq-length 32768 --max-position-embeddings 32768 --global-batch-size 2 --train-iters 14 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --no-create-attention-mask-in-dataloader"
CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --nproc_per_node 1 --master_port 29904 pretrain_gpt.py $CPF > $OUT/ours_cp1_32k.log 2>&1
python3 $R/res.py ours_cp1_32k 2 1 $OUT/ours_cp1_32k.log 32768 0; el cp1
timeout 150 torchrun --nproc_per_node 2 --master_port 29905 pretrain_gpt.py $CPF --context-parallel-size 2 --cp-comm-type p2p > $OUT/ours_cp2_32k.log 2>&1
python3 $R/res.py ours_cp2_32k 2 2 $OUT/ours_cp2_32k.log 32768 0; el cp2
grep -h "MFU" $OUT/ours_cp1_32k.log $OUT/ours_cp2_32k.log | tail -2
timeout $(( 400 - ($(date +%s) - T0) )) python3 -m pytest -q -x tests/gpu/test_context_parallel_gpu.py -k "p2p" > $OUT/cp_tests.txt 2>&1; el tests rc=$?; tail -3 $OUT/cp_tests.txt
