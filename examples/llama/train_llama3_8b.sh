#!/usr/bin/env bash
# Llama-3-8B-style model (32 layers x 4096 hidden, 32 heads with 8 KV groups (GQA), SwiGLU FFN 14336,
# RMSNorm, RoPE base 500000, untied embeddings, no linear biases, seq 8192, vocab 128256) on one node of
# 8 GPUs: TP=2 x DP=4 with sequence parallelism and the distributed optimizer, bf16.
# ~3 min to the first log lines. Mock data by default; for real data pass DATA_PATH and TOKENIZER_MODEL
# (a local HuggingFace tokenizer.json or directory used to preprocess it).
#
#   bash examples/llama/train_llama3_8b.sh
#   GPUS_PER_NODE=2 CKPT_DIR= bash examples/llama/train_llama3_8b.sh --global-batch-size 4 --train-iters 10
#       (2 GPUs, TP=2: a quick trial without checkpoints; extra flags override the ones above)
#   DATA_PATH=/data/fineweb_text_document TOKENIZER_MODEL=/models/llama3/tokenizer.json bash examples/llama/train_llama3_8b.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-1}
CKPT_DIR=${CKPT_DIR-checkpoints/llama3_8b}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
    --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --make-vocab-size-divisible-by 128
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 128      # 128 x 8192 = 1.05M tokens per step
    --train-iters 25000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --bf16 --cross-entropy-loss-fusion
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
if (( TP > 1 )); then  # the sequence-parallel all-gather / reduce-scatter overlapped with the GEMMs
    PARALLEL_ARGS+=(--tp-comm-overlap)
fi
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0
               --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128256)
fi
OUTPUT_ARGS=(--log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 5)
if [[ -n "$CKPT_DIR" ]]; then  # CKPT_DIR= (empty): no checkpoints, no TensorBoard (a quick trial)
    OUTPUT_ARGS+=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --tensorboard-dir "$CKPT_DIR/tensorboard")
fi

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
