#!/usr/bin/env bash
# BERT-large (340M: 24 layers, hidden 1024, 16 heads) on one node of 8 GPUs, Megatron-LM's classic flags.
#   bash examples/bert/train_bert_340m_distributed.sh <checkpoint dir> <tensorboard dir> <vocab.txt> <data prefix>
# The data prefix is tools/preprocess_data.py --split-sentences output (e.g. my-bert_text_sentence).
# Tokens per iteration: 256 samples x 512 = 131,072. Add --bert-no-binary-head to drop sentence order.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CHECKPOINT_PATH=$1 TENSORBOARD_LOGS_PATH=$2 VOCAB_FILE=$3 DATA_PATH=$4
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "${NUM_NODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" pretrain_bert.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size 4 --global-batch-size 256 \
    --lr 1e-4 --train-iters 1000000 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1e-5 \
    --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16 \
    --tensor-model-parallel-size 1 \
    --data-path "$DATA_PATH" --split 949,50,1 \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE" \
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH" "${@:5}"
