#!/usr/bin/env bash
# GPT-2 small (124M: 12 layers x 768 hidden x 12 heads, seq 1024) on one GPU in bf16.
# Shows: a single-process run with the full log line (throughput in TFLOP/s/GPU), checkpoints and
# TensorBoard. ~1 min to the first log lines; 5000 iterations take about an hour on one H100.
# Mock data by default; DATA_PATH=<prefix> (with VOCAB_FILE/MERGE_FILE of the tokenizer used to
# preprocess it) trains on real data.
#
#   bash examples/gpt/train_gpt_single_gpu.sh
#   FAST=1 bash examples/gpt/train_gpt_single_gpu.sh   # compiled layers, chunked loss, whole-step CUDA graph
#   DATA_PATH=/data/owt_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt bash examples/gpt/train_gpt_single_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

CKPT_DIR=${CKPT_DIR:-checkpoints/gpt_125m}
TB_DIR=${TB_DIR:-$CKPT_DIR/tensorboard}

MODEL_ARGS=(
    --num-layers 12 --hidden-size 768 --num-attention-heads 12
    --seq-length 1024 --max-position-embeddings 1024
    --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size 16 --global-batch-size 64       # 4 micro-batches; 64 x 1024 = 65,536 tokens/iteration
    --train-iters 5000 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 200
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16
)
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:-data/vocab.json}" --merge-file "${MERGE_FILE:-data/merges.txt}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
OUTPUT_ARGS=(
    --log-interval 10 --log-throughput --eval-interval 500 --eval-iters 10
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000
    --tensorboard-dir "$TB_DIR"
)

# The fast path (docs/performance.md): each flag also works alone.
FAST_ARGS=()
if [[ "${FAST:-0}" == 1 ]]; then
    FAST_ARGS=(--torch-compile --cross-entropy-loss-fusion --cuda-graph-impl full_iteration)
fi

python pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    "${FAST_ARGS[@]}" "$@"
