#!/usr/bin/env bash
# Tiny DeepSeek-style fine-grained MoE on CPU: 16 small experts (FFN 32), top-4, one shared expert,
# sigmoid router with aux-loss-free expert bias, group-limited routing (4 groups, 2 per token), the
# first layer dense (--moe-layer-freq pattern), EP=2 on 2 gloo processes; 12 iterations, ~30-60 s on 2 cores.
#
#   bash examples/deepseek/train_deepseek_moe_tiny_cpu.sh
# Tokens per iteration: 8 samples x 64 = 512; each token runs 4 routed experts + the shared one.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

TRAIN_ITERS=${TRAIN_ITERS:-12}
MODEL_ARGS=(
    --num-layers 3 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4
    --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 16 --moe-ffn-hidden-size 32 --moe-router-topk 4 --moe-shared-expert-intermediate-size 64
    --moe-layer-freq "([0]*1+[1]*2)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --expert-model-parallel-size 2
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0)
OUTPUT_ARGS=(--log-interval 4 --eval-interval "$TRAIN_ITERS" --eval-iters 1 --distributed-backend gloo)

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
