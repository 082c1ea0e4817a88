#!/usr/bin/env bash
# Tiny Mixtral-style MoE on CPU: 8 experts, top-2, softmax router with the load-balancing aux loss,
# all-to-all dispatch over EP=2 (2 gloo processes), grouped experts, 12 iterations, ~30-60 s on 2 cores.
# The log line shows load_balancing_loss after lm loss, and the expert load spread (max/min over mean).
#
#   bash examples/mixtral/train_mixtral_tiny_cpu.sh
# Tokens per iteration: 8 samples x 64 = 512; each token runs 2 of the 8 experts.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

TRAIN_ITERS=${TRAIN_ITERS:-12}
MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope --rotary-base 1000000
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --expert-model-parallel-size 2
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0)
OUTPUT_ARGS=(--log-interval 4 --eval-interval "$TRAIN_ITERS" --eval-iters 1 --distributed-backend gloo)

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
