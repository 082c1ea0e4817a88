#!/usr/bin/env bash
# Nemotron-H-8B-shaped hybrid on one H100/H200: hidden 4096, Mamba-2 with 128 heads of 64, state 128, 8 groups,
# squared-ReLU MLP 21504, GQA attention 32/8, no position embedding, seq 8192, vocab 131072, bf16.
# Cut in layers to fit one GPU: the 52-layer model (24 Mamba-2, 24 MLP, 4 attention) becomes the first
# 13 layers of the same rhythm, "M-M-M-M*-M-M-" (~2.8B parameters with the embeddings); LAYERS=full with
# more GPUs (TP=2/4, the distributed optimizer) runs all 52. ~3-5 min to the first log lines (Triton
# compiles the scan kernels on the first iterations). Needs `MAMBA_SKIP_CUDA_BUILD=TRUE pip install mamba-ssm`
# for the Triton SSD kernel (else the eager scan runs, much slower). Mock data unless DATA_PATH is set.
#
#   bash examples/hybrid/train_nemotron_h_8b_shaped.sh
#   DATA_PATH=data/processed/corpus_text_document bash examples/hybrid/train_nemotron_h_8b_shaped.sh
#   DATA_PATH=/data/my_text_document TOKENIZER_MODEL=/models/tokenizer bash examples/hybrid/train_nemotron_h_8b_shaped.sh
# (the first: the shipped corpus as scripts/quickstart.sh tokenizes it, with the GPT-2 BPE files in data/)
# Tokens per iteration: 8 samples x 8192 = 65,536. MFU in the log uses Megatron's hybrid FLOPs formula.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS=${GPUS:-1}
if [ "${LAYERS:-cut}" = "full" ]; then
    PATTERN="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-"  # 24 M, 24 -, 4 *: 52 layers
else
    PATTERN="M-M-M-M*-M-M-"
fi
MODEL_ARGS=(
    --hybrid-layer-pattern "$PATTERN" --hidden-size 4096 --ffn-hidden-size 21504 --squared-relu
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --mamba-num-heads 128 --mamba-head-dim 64 --mamba-state-dim 128 --mamba-num-groups 8
    --position-embedding-type none --normalization RMSNorm --disable-bias-linear
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --seq-length 8192 --max-position-embeddings 8192 --init-method-std 0.014
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8 --train-iters "${TRAIN_ITERS:-50}"
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1
    --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
    --tensor-model-parallel-size "${TP:-1}"
)
if [ -n "${DATA_PATH:-}" ]; then
    if [ -n "${TOKENIZER_MODEL:-}" ]; then
        TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
    else
        TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file data/vocab.json --merge-file data/merges.txt)
    fi
    DATA_ARGS=(--data-path "$DATA_PATH" "${TOKENIZER_ARGS[@]}" --split 99,1,0)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 131072)
fi
OUTPUT_ARGS=(--log-interval 5 --eval-interval 1000 --eval-iters 1 --log-throughput)

torchrun --standalone --nproc-per-node "$GPUS" pretrain_hybrid.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
