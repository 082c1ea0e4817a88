#!/usr/bin/env bash
# BERT end to end on the shipped corpus, on CPU (or one GPU): sentence-split preprocessing with the shipped
# lower-case WordPiece vocab, then a tiny BERT (2 layers, hidden 64) for 40 iterations at TP=2 on 2 processes.
# ~40 s on 2 cores; lm loss falls from ~9.0 to ~6.3 and sop loss stays near ln 2 = 0.69 at this size.
#
#   bash examples/bert/train_bert_tiny_cpu.sh
# Tokens per iteration: 16 samples x 64 = 1,024.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-data/processed}
PREFIX=$OUT/corpus_bert
mkdir -p "$OUT"
if [ ! -f "${PREFIX}_text_sentence.idx" ]; then
    python tools/preprocess_data.py --input data/corpus.jsonl.gz --output-prefix "$PREFIX" \
        --tokenizer-type BertWordPieceLowerCase --vocab-file data/bert-vocab.txt --split-sentences --workers 2
fi
torchrun --nproc-per-node 2 pretrain_bert.py \
    --tensor-model-parallel-size 2 \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
    --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 4 --global-batch-size 16 \
    --train-iters 40 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 4 \
    --data-path "${PREFIX}_text_sentence" --split 98,1,1 \
    --tokenizer-type BertWordPieceLowerCase --vocab-file data/bert-vocab.txt \
    --log-interval 5 --eval-interval 20 --eval-iters 2 --num-workers 0 \
    --save "$OUT/ckpt_bert_tiny" --save-interval 40 "$@"
