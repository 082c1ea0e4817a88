#!/usr/bin/env bash
# Tiny Llama-style GPT on CPU (the Llama-3 architecture at toy size: GQA, RoPE, RMSNorm, SwiGLU, untied
# embeddings, no linear biases) on 2 gloo processes at TP=2 with the distributed optimizer, 20 iterations,
# ~30-60 s on 2 cores. Shows: the Llama flags, checkpoint save and resume. To see a resume, stop early
# with EXIT_INTERVAL=10 (saves and exits at iteration 10), then rerun the same command without it.
#
#   EXIT_INTERVAL=10 bash examples/llama/train_llama_tiny_cpu.sh && bash examples/llama/train_llama_tiny_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

TRAIN_ITERS=${TRAIN_ITERS:-20}
CKPT_DIR=${CKPT_DIR:-checkpoints/llama_tiny_cpu}

MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 192
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64
    --position-embedding-type rope --rotary-base 500000
    --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --use-distributed-optimizer --distributed-backend gloo)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0)
OUTPUT_ARGS=(
    --log-interval 5 --eval-interval "$TRAIN_ITERS" --eval-iters 2
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "$TRAIN_ITERS"
    ${EXIT_INTERVAL:+--exit-interval "$EXIT_INTERVAL"}
)

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
