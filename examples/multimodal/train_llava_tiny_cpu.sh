#!/usr/bin/env bash
# Tiny LLaVA on CPU: a 2-layer ViT (32x32 images, 8x8 patches) + projector + a 2-layer Llama-style decoder,
# on a synthetic image-caption set, 2 gloo processes at TP=2, 20 iterations (~1 min on 2 cores).
# ENERGON=1 first converts the set with tools/prepare_vlm_energon.py (needs `pip install megatron-energon`).
#
#   bash examples/multimodal/train_llava_tiny_cpu.sh
#   ENERGON=1 bash examples/multimodal/train_llava_tiny_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DATA_DIR=${DATA_DIR:-/tmp/vlm_tiny}
[[ -f "$DATA_DIR/train.jsonl" ]] || python tools/make_image_text_set.py --output "$DATA_DIR" --samples 64
DATA_PATH="$DATA_DIR/train.jsonl"
if [[ -n "${ENERGON:-}" ]]; then
    [[ -d "$DATA_DIR/energon" ]] || python tools/prepare_vlm_energon.py --input "$DATA_PATH" \
        --output "$DATA_DIR/energon" --split 90,10,0 --samples-per-shard 16
    DATA_PATH="$DATA_DIR/energon"
fi

MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --position-embedding-type rope
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --seq-length 64 --max-position-embeddings 64 --attention-dropout 0.0 --hidden-dropout 0.0
)
VISION_ARGS=(
    --vision-model-type clip --img-h 32 --img-w 32 --patch-dim 8 --encoder-num-layers 2
    --vision-hidden-size 48 --vision-num-attention-heads 4 --disable-vision-class-token
    --image-token-index 510    # an id the captions never use marks an image (511 is NullTokenizer's end of document)
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 3e-3 --min-lr 3e-4
    --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(--data-path "$DATA_PATH" --split 90,10,0 --tokenizer-type NullTokenizer --vocab-size 512 --num-workers 1)
OUTPUT_ARGS=(--log-interval 5 --eval-interval 20 --eval-iters 2)

torchrun --standalone --nproc-per-node 2 pretrain_vlm.py --tensor-model-parallel-size 2 --distributed-backend gloo \
    "${MODEL_ARGS[@]}" "${VISION_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
