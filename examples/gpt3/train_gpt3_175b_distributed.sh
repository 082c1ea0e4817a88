#!/usr/bin/env bash
# GPT-3 175B (96 layers x 12288 hidden x 96 heads, seq 2048) on 16 nodes x 8 GPUs: TP=8 x PP=16 x DP=1,
# fp16 with dynamic loss scaling, the GPT-3 paper's schedule (batch ramp-up 16 -> 1536 over 5.9M samples,
# cosine 6e-5 -> 6e-6, 300B tokens). Shows a sample-based run and a multi-node torchrun launch; run it on
# every node with NODE_RANK and MASTER_ADDR set. Start-up takes ~10 min; the run itself takes weeks.
# Positional arguments as in Megatron-LM's example (all optional; empty DATA_PATH means mock data):
#
#   bash examples/gpt3/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_DIR VOCAB_FILE MERGE_FILE DATA_PATH
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

CHECKPOINT_PATH=${1:-checkpoints/gpt3_175b}
TENSORBOARD_DIR=${2:-$CHECKPOINT_PATH/tensorboard}
VOCAB_FILE=${3:-data/vocab.json}
MERGE_FILE=${4:-data/merges.txt}
DATA_PATH=${5:-}

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-16}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96
    --seq-length 2048 --max-position-embeddings 2048
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 1536
    --rampup-batch-size 16 16 5859375                  # +16 samples per step until 1536, over 5.86M samples
    --train-samples 146484375                          # 300B tokens / 2048
    --lr-decay-samples 126953125 --lr-warmup-samples 183105
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --init-method-std 0.006
    --fp16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16   # 96 layers: 6 per stage
    --sequence-parallel --use-distributed-optimizer
)
if [[ -n "$DATA_PATH" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type GPT2BPETokenizer
               --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
OUTPUT_ARGS=(
    --log-interval 100 --log-throughput --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 10000
    --tensorboard-dir "$TENSORBOARD_DIR"
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}"
