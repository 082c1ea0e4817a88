#!/usr/bin/env bash
# Llama-3-8B layer shape (4096 hidden, 32 heads / 8 KV groups, SwiGLU 14336, RMSNorm, RoPE base 500000,
# vocab 128256, untied, no biases) at sequence length 65536 with context parallelism over every GPU of the
# node (CP = GPU count, e.g. CP=2 on 2 GPUs): ring attention (--cp-comm-type p2p), full activation
# recompute, the distributed optimizer sharded over the CP ranks, bf16. NUM_LAYERS (default 16) sets how
# many of the 32 layers to build: 16 fit on two 141 GB H200s (see the memory estimate printed at start).
# ~3 min to the first log lines. Packed documents with per-document attention: PACKED=1 (needs DATA_PATH,
# a preprocessed corpus with EOD tokens; mock data has few boundaries).
#
#   bash examples/long_context/train_llama3_8b_64k.sh
#   NUM_LAYERS=8 GPUS=4 bash examples/long_context/train_llama3_8b_64k.sh --cp-comm-type a2a
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS=${GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
GPUS=$(( GPUS > 0 ? GPUS : 2 ))
SEQ=${SEQ:-65536}
NUM_LAYERS=${NUM_LAYERS:-16}
CKPT_DIR=${CKPT_DIR:-checkpoints/llama3_8b_64k}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --position-embedding-type rope --rotary-base 500000
    --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8      # 8 x 65536 = 524,288 tokens per step
    --train-iters 1000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 50
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16 --cross-entropy-loss-fusion
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
PARALLEL_ARGS=(
    --context-parallel-size "$GPUS" --cp-comm-type p2p
    --use-distributed-optimizer --overlap-grad-reduce
)
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0
               --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128255)
fi
if [[ "${PACKED:-0}" == 1 ]]; then
    DATA_ARGS+=(--reset-attention-mask --reset-position-ids --eod-mask-loss)
fi
OUTPUT_ARGS=(
    --log-interval 1 --log-throughput --eval-interval 500 --eval-iters 2
    --save "$CKPT_DIR" --save-interval 500
)

torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
