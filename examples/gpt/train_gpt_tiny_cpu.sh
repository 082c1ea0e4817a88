#!/usr/bin/env bash
# Tiny GPT on CPU: 2 processes over gloo at tensor-parallel size 2, 30 iterations, ~30-60 s on 2 cores.
# Shows: the torchrun launch, Megatron's per-iteration log line, TP on CPU, and save/resume (stop early
# with EXIT_INTERVAL=15, which saves and exits, then rerun the same command: it loads the checkpoint and
# continues). Mock data by default; DATA_PATH=<prefix> trains on a .bin/.idx pair made with the shipped
# tokenizer (see examples/data/preprocess_data.sh).
#
#   bash examples/gpt/train_gpt_tiny_cpu.sh
#   DATA_PATH=data/processed/corpus_text_document TRAIN_ITERS=60 bash examples/gpt/train_gpt_tiny_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

NPROC=${NPROC:-2}
TP=${TP:-2}
TRAIN_ITERS=${TRAIN_ITERS:-30}
CKPT_DIR=${CKPT_DIR:-checkpoints/gpt_tiny_cpu}

MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4
    --seq-length 64 --max-position-embeddings 64
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8        # 8 x 64 = 512 tokens per iteration
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size 1
    --distributed-backend gloo
)
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 98,2,0 --tokenizer-type GPT2BPETokenizer
               --vocab-file data/vocab.json --merge-file data/merges.txt --num-workers 0)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0)
fi
OUTPUT_ARGS=(
    --log-interval 5 --eval-interval "$TRAIN_ITERS" --eval-iters 2
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "$TRAIN_ITERS"
    ${EXIT_INTERVAL:+--exit-interval "$EXIT_INTERVAL"}
)

torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
