#!/usr/bin/env bash
# T5-base (220M: 12 + 12 layers, hidden 768, 12 heads, kv 64, ffn 3072) on one node of 8 GPUs,
# Megatron-LM's classic flags.
#   bash examples/t5/train_t5_220m_distributed.sh <checkpoint dir> <tensorboard dir> <vocab.txt> <data prefix>
# The data prefix is tools/preprocess_data.py --split-sentences output with BertWordPieceCase.
# Encoder tokens per iteration: 512 samples x 512 = 262,144.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CHECKPOINT_PATH=$1 TENSORBOARD_DIR=$2 VOCAB_FILE=$3 DATA_PATH=$4
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "${NUM_NODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" pretrain_t5.py \
    --encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --kv-channels 64 --ffn-hidden-size 3072 \
    --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512 \
    --micro-batch-size 64 --global-batch-size 512 \
    --lr 0.0001 --train-iters 1000000 --lr-decay-iters 1000000 --lr-decay-style linear --min-lr 0.00001 \
    --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16 \
    --tensor-model-parallel-size 1 \
    --data-path "$DATA_PATH" --split 949,50,1 \
    --tokenizer-type BertWordPieceCase --vocab-file "$VOCAB_FILE" --vocab-extra-ids 100 \
    --log-interval 100 --save-interval 5000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_DIR" "${@:5}"
