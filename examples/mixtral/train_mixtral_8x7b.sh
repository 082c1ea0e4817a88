#!/usr/bin/env bash
# Mixtral-8x7B architecture (32 layers x 4096 hidden, GQA 32/8, 8 experts of SwiGLU FFN 14336, top-2,
# RoPE base 1e6, RMSNorm, untied embeddings, seq 4096, vocab 32000) on 8 GPUs per node: expert
# parallelism EP=8 (one expert per GPU, all-to-all dispatch), PP=4 over 4 nodes, grouped-GEMM experts,
# the aux load-balancing loss, bf16 and the distributed optimizer. ~5 min to the first log lines.
# Mock data by default; pass DATA_PATH and TOKENIZER_MODEL for real data.
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/mixtral/train_mixtral_8x7b.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CKPT_DIR=${CKPT_DIR:-checkpoints/mixtral_8x7b}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 32768 --position-embedding-type rope --rotary-base 1000000
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights
    --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.01
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion
    --expert-model-parallel-size 8
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 256 --train-iters 500000
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --sequence-parallel)
if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "$TOKENIZER_MODEL")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
fi
OUTPUT_ARGS=(--log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10
             --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
