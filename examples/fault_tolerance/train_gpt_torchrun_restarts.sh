#!/usr/bin/env bash
# GPT 1.3B on one node of 8 GPUs that restarts itself: torchrun restarts every rank when one fails (a lost
# GPU, a NCCL hang that hits the timeout, a crash), up to MAX_RESTARTS times, and each launch resumes from
# the latest complete checkpoint under CKPT_DIR (--load = --save: the same command every time). The log
# of each launch opens with its number and how the previous one ended (CKPT_DIR/launch_record.json).
# ~3 min to the first log lines; a restart costs the start-up plus the steps since the last save.
# docs/fault_tolerance.md explains each fault.
#
#   bash examples/fault_tolerance/train_gpt_torchrun_restarts.sh
#   MAX_RESTARTS=10 GPUS_PER_NODE=2 bash examples/fault_tolerance/train_gpt_torchrun_restarts.sh --train-iters 200
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
MASTER_PORT=${MASTER_PORT:-6000}
CKPT_DIR=${CKPT_DIR:-checkpoints/gpt_1.3b_restarts}

LAUNCH_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --master-addr localhost --master-port "$MASTER_PORT"
    --max-restarts "$MAX_RESTARTS"   # every rank is restarted when one fails
    --monitor-interval 5             # seconds between torchrun's checks of its workers
)
MODEL_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 256
    --train-iters 20000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 500
    --weight-decay 0.1 --clip-grad 1.0 --bf16 --use-distributed-optimizer
    --mock-data --tokenizer-type NullTokenizer --vocab-size 50257
)
FAULT_TOLERANCE_ARGS=(
    --save "$CKPT_DIR" --load "$CKPT_DIR"   # every launch resumes from the latest complete checkpoint
    --save-interval 200 --async-save        # frequent saves that do not stop training while they write
    --ckpt-fallback-to-previous             # a truncated or corrupt latest checkpoint: load the one before
    --exit-signal-handler                   # SIGTERM (preemption): finish the step, save, exit 0
    --distributed-timeout-minutes 10        # a hang ends within 10 min; each rank dumps its stacks first
    --flight-recorder-dump-path "$CKPT_DIR/hang_dumps/rank"
)

torchrun "${LAUNCH_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${FAULT_TOLERANCE_ARGS[@]}" --log-interval 10 --eval-iters 0 "$@"
