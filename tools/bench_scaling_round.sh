#!/bin/bash
# One 2-GPU call for tools/scaling_model.py: the NVLink bus bandwidths (measure-bandwidth), then Llama-3-8B layers
# (8 of 32, seq 8192) on one GPU, at CP=2 (the published Llama-3.1-8B layout's CP) and at DP=2, each with
# Megatron's flags through pretrain_gpt.py. Logs and bw.json under $OUT. Needs ../shared/megatron_reference
# copied to .mref/ (configs.sh, res.py); run from the repository root.
set -u
R=$(pwd)/.mref; OUT=${OUT:-/tmp/scaling}; mkdir -p $OUT
source $R/configs.sh
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/device.txt
timeout 120 torchrun --nproc-per-node 2 --master_port 29911 tools/scaling_model.py measure-bandwidth \
  --out $OUT/bw.json --sizes-mb 0.25 1 4 16 64 256 > $OUT/bw.txt 2>&1; el bandwidth; grep busbw $OUT/bw.txt
L8="$LLAMA8B --num-layers 8 --train-iters 20 --no-create-attention-mask-in-dataloader"
CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --nproc_per_node 1 --master_port 29912 pretrain_gpt.py $L8 \
  --global-batch-size 4 > $OUT/l8_1gpu.log 2>&1
python3 $R/res.py l8_1gpu 4 1 $OUT/l8_1gpu.log 8192 0; el 1gpu
timeout 150 torchrun --nproc_per_node 2 --master_port 29913 pretrain_gpt.py $L8 --global-batch-size 4 \
  --context-parallel-size 2 --cp-comm-type p2p --overlap-grad-reduce --overlap-param-gather > $OUT/l8_cp2.log 2>&1
python3 $R/res.py l8_cp2 4 2 $OUT/l8_cp2.log 8192 0; el cp2
timeout 150 torchrun --nproc_per_node 2 --master_port 29914 pretrain_gpt.py $L8 --global-batch-size 8 \
  --overlap-grad-reduce --overlap-param-gather > $OUT/l8_dp2.log 2>&1
python3 $R/res.py l8_dp2 8 2 $OUT/l8_dp2.log 8192 0; el dp2
