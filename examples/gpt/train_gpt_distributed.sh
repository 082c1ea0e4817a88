#!/usr/bin/env bash
# GPT 1.3B (24 layers x 2048 hidden x 16 heads, seq 2048) on 8 GPUs of one node with torchrun:
# TP=2 x PP=2 x DP=2, sequence parallelism, the distributed optimizer and overlapped grad/param
# communication. Shows how the three degrees multiply to the world size (2 x 2 x 2 = 8).
# ~2 min to the first log lines. For several nodes run it on each with NNODES, NODE_RANK and
# MASTER_ADDR set (or use train_gpt_multinode.sbatch under SLURM).
#
#   bash examples/gpt/train_gpt_distributed.sh
#   TP=4 PP=1 bash examples/gpt/train_gpt_distributed.sh          # DP becomes 2
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # keeps overlapped communication kernels in issue order

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-2}
CKPT_DIR=${CKPT_DIR:-checkpoints/gpt_1.3b}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 256      # DP=2: 32 micro-batches per DP rank per step
    --train-iters 20000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 500
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:-data/vocab.json}" --merge-file "${MERGE_FILE:-data/merges.txt}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
OUTPUT_ARGS=(
    --log-interval 10 --log-throughput --timing-log-level 1
    --eval-interval 1000 --eval-iters 10
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --async-save
    --tensorboard-dir "$CKPT_DIR/tensorboard"
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
