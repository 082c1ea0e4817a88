#!/usr/bin/env bash
# Tiny Llama-style GPT on CPU with context parallelism: 2 gloo processes at CP=2 (ring attention), sequence
# 256 split into 4 chunks (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2), packed documents
# (--reset-attention-mask --reset-position-ids --eod-mask-loss: attention stays inside each document),
# 10 iterations, ~20-40 s on 2 cores. The memory estimate printed at start counts activations per CP rank.
#
#   bash examples/long_context/train_long_context_tiny_cpu.sh
#   bash examples/long_context/train_long_context_tiny_cpu.sh --cp-comm-type a2a
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

TRAIN_ITERS=${TRAIN_ITERS:-10}

MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 192
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 256 --max-position-embeddings 256
    --position-embedding-type rope --rotary-base 500000
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 2 --global-batch-size 4
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(--context-parallel-size 2 --cp-comm-type p2p --use-distributed-optimizer --distributed-backend gloo)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0
           --reset-attention-mask --reset-position-ids --eod-mask-loss)
OUTPUT_ARGS=(--log-interval 1 --eval-iters 0)

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
