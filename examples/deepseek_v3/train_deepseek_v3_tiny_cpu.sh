#!/usr/bin/env bash
# Tiny DeepSeek-V3-style GPT on CPU: multi-latent attention with YaRN, one dense layer then MoE layers (8 routed
# experts, a shared expert, sigmoid router with expert bias, group-limited routing), one multi-token prediction
# depth; 2 gloo processes with expert parallelism 2 (EP=2 x DP=2), 20 iterations, ~30-60 s on 2 cores.
# The log line shows `mtp_1 loss` next to `lm loss`; validation reports the main prediction only.
#
#   bash examples/deepseek_v3/train_deepseek_v3_tiny_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

TRAIN_ITERS=${TRAIN_ITERS:-20}

MODEL_ARGS=(
    --num-layers 3 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --seq-length 64 --max-position-embeddings 64
    --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16
    --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm
    --position-embedding-type rope --rotary-base 10000
    --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 16
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 8 --moe-layer-freq "([0]*1+[1]*2)" --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32 --moe-router-topk 2
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
    --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(--expert-model-parallel-size 2 --use-distributed-optimizer --distributed-backend gloo)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 0)
OUTPUT_ARGS=(--log-interval 5 --eval-interval "$TRAIN_ITERS" --eval-iters 2)

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${MTP_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
