#!/usr/bin/env bash
# DeepSeek-V3-shaped model cut to fit two H200s: the V3 recipe (MLA with q/kv low rank and YaRN, the first layer
# dense and the rest MoE with 64 fine-grained routed experts + 1 shared expert, sigmoid router with expert bias
# and group-limited routing, one MTP depth) at hidden 2048 and 8 layers: ~5.3B parameters, ~1.4B active per token.
# EP=2 over the 2 GPUs (DP=2 for the dense part), bf16, seq 4096, mock data; 30 iterations, first logs in ~2 min.
# Prints tokens/s and MFU over active parameters (--log-throughput) after each log line.
#
# Sizes against DeepSeek-V3 (hidden 7168, 61 layers, 128 heads, 256 experts top-8, ffn 18432 / expert 2048):
# per token 16 heads x (128 + 64) q/k dims; 64 experts of ffn 1408 in 8 groups, top-8 from 4 groups (as V3),
# plus 1 shared expert of 2816.
#
#   bash examples/deepseek_v3/train_deepseek_v3_2gpu.sh [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

MODEL_ARGS=(
    --num-layers 8 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16
    --seq-length 4096 --max-position-embeddings 4096
    --multi-latent-attention --q-lora-rank 768 --kv-lora-rank 512
    --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
    --position-embedding-type rope --rotary-base 10000
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 4096
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
    --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006
    --vocab-size 129280 --make-vocab-size-divisible-by 128
)
MOE_ARGS=(
    --num-experts 64 --moe-layer-freq "([0]*1+[1]*7)" --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 2816 --moe-router-topk 8
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion
)
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 16 --train-iters 30
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --seed 1234
)
PARALLEL_ARGS=(--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce
               --distributed-backend nccl)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --split 1,0,0 --num-workers 1)
OUTPUT_ARGS=(--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000)

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${MTP_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
