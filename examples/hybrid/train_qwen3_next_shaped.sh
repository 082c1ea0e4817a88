#!/usr/bin/env bash
# Qwen3-Next-shaped hybrid (Gated DeltaNet + attention every 4th layer, each followed by an MoE layer) on one
# GPU: hidden 2048, Gated DeltaNet with 16 key heads / 32 value heads of 128 (conv 4), attention 16 heads /
# 2 KV groups of 256 with RoPE, MoE of 512-wide experts top-10 plus a 512-wide shared expert, seq 4096, bf16.
# Cut to fit one GPU: 8 of the 48 layers ("GEGEGE*E" x 2) and 64 of the 512 experts; EP over more GPUs
# (EXPERTS=512 GPUS=8 EP=8) for the full width. ~3-5 min to the first log lines (Triton compiles).
# Needs `pip install flash-linear-attention` for the Triton gated delta rule (else the eager scan runs).
# Not Qwen3-Next's: its gated attention output (attention_output_gate) is not built here; plain attention runs.
#
#   bash examples/hybrid/train_qwen3_next_shaped.sh
# Tokens per iteration: 8 samples x 4096 = 32,768.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS=${GPUS:-1}
MODEL_ARGS=(
    --hybrid-layer-pattern "GEGEGE*EGEGEGE*E" --hidden-size 2048
    --num-attention-heads 16 --group-query-attention --num-query-groups 2 --kv-channels 256 --qk-layernorm
    --linear-num-key-heads 16 --linear-num-value-heads 32 --linear-key-head-dim 128 --linear-value-head-dim 128
    --linear-conv-kernel-dim 4
    --num-experts "${EXPERTS:-64}" --moe-router-topk 10 --moe-ffn-hidden-size 512
    --moe-shared-expert-intermediate-size 512 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --expert-model-parallel-size "${EP:-1}"
    --ffn-hidden-size 5120 --swiglu --position-embedding-type rope --rotary-base 10000000 --rotary-percent 0.25
    --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --seq-length 4096 --max-position-embeddings 4096
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8 --train-iters "${TRAIN_ITERS:-50}"
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1
    --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 151936)
OUTPUT_ARGS=(--log-interval 5 --eval-interval 1000 --eval-iters 1 --log-throughput)

torchrun --standalone --nproc-per-node "$GPUS" pretrain_hybrid.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
