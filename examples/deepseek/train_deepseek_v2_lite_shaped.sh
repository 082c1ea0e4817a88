#!/usr/bin/env bash
# DeepSeek-V2-Lite-shaped fine-grained MoE with standard attention (27 layers x 2048 hidden, the first
# layer dense with FFN 10944, then 64 routed experts of FFN 1408, top-6, 2 shared experts (FFN 2816),
# sigmoid router with aux-loss-free expert bias and group-limited routing, seq 4096) on one node of
# 8 GPUs: EP=8, bf16, the distributed optimizer. ~3 min to the first log lines. Multi-latent attention
# comes with --multi-latent-attention where supported; this script keeps GQA attention.
#
#   bash examples/deepseek/train_deepseek_v2_lite_shaped.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CKPT_DIR=${CKPT_DIR:-checkpoints/deepseek_v2_lite_shaped}
MODEL_ARGS=(
    --num-layers 27 --hidden-size 2048 --ffn-hidden-size 10944
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
    --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 64 --moe-ffn-hidden-size 1408 --moe-router-topk 6 --moe-shared-expert-intermediate-size 2816
    --moe-layer-freq "([0]*1+[1]*26)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 3
    --moe-router-topk-scaling-factor 1.0 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion
    --moe-shared-expert-overlap --expert-model-parallel-size 8
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 64 --train-iters 100000
    --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 102400)
OUTPUT_ARGS=(--log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10
             --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000)

torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
