#!/usr/bin/env bash
# Tiny hybrid model on CPU: Mamba-2 (M), Gated DeltaNet (G), attention (*), MLP (-) and MoE (E) layers from
# one --hybrid-layer-pattern, TP=2 over 2 gloo processes, mock data, 20 iterations, ~30-60 s on 2 cores.
# The scans run on the eager PyTorch references (no Triton on CPU); the loss falls from ~6.2.
#
#   bash examples/hybrid/train_hybrid_tiny_cpu.sh
# Tokens per iteration: 8 samples x 64 = 512.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

TRAIN_ITERS=${TRAIN_ITERS:-20}
MODEL_ARGS=(
    --hybrid-layer-pattern "M*-G-E" --hidden-size 64 --ffn-hidden-size 128
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2
    --linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 4
    --num-experts 4 --moe-router-topk 2
    --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
    --normalization RMSNorm --swiglu --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel
    --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0)
OUTPUT_ARGS=(--log-interval 4 --eval-interval "$TRAIN_ITERS" --eval-iters 1 --distributed-backend gloo)

torchrun --standalone --nproc-per-node 2 pretrain_hybrid.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
