#!/usr/bin/env bash
# LLaVA-1.5-style model: CLIP ViT-L/14 at 336 px (24 layers x 1024, 16 heads, quick GeLU; 576 patch
# features, class token dropped) + a 2-layer GeLU projector + a Llama-3-8B-shaped decoder (4096 hidden,
# 32 heads / 8 KV groups, SwiGLU 14336, RoPE 500000), bf16, decoder sequence 1024 (576 image + 448 text).
# One GPU by default with the decoder cut to NUM_LAYERS=8 (~2.9B parameters incl. the ViT, ~45 GB with the
# distributed optimizer); a node of 8 GPUs takes the full 32 layers with GPUS_PER_NODE=8 TP=4 PP=2 NUM_LAYERS=32.
# ~2 min to the first log lines (plus ~1 min to write the synthetic set on first use).
# Data: DATA_PATH (a JSONL of image-text samples or an Energon folder) with TOKENIZER_MODEL, else a
# synthetic 336 px image-caption set is written to SYNTH_DIR and read with NullTokenizer ids.
#
#   bash examples/multimodal/train_llava_7b.sh
#   bash examples/multimodal/train_llava_7b.sh --train-iters 50 --timing-log-level 2   # data-wait timer
#   GPUS_PER_NODE=8 TP=4 PP=2 NUM_LAYERS=32 bash examples/multimodal/train_llava_7b.sh
#   LOAD=/ckpt/llava_imported bash examples/multimodal/train_llava_7b.sh   (tools/checkpoint/hf.py import output)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-1}
TP=${TP:-1}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-8}
SYNTH_DIR=${SYNTH_DIR:-/tmp/vlm_synthetic_336}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 1024 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
)
VISION_ARGS=(                                   # CLIP ViT-L/14-336: 24 x 24 patches = 576 features
    --vision-model-type clip --img-h 336 --img-w 336 --patch-dim 14 --encoder-num-layers 24
    --vision-hidden-size 1024 --vision-ffn-hidden-size 4096 --vision-num-attention-heads 16
    --disable-vision-class-token --vision-projection-type mlp
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 32      # 32 x 1024 = 32768 decoder positions per step
    --train-iters ${TRAIN_ITERS:-200} --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 20
    --weight-decay 0.0 --adam-beta2 0.95 --clip-grad 1.0 --bf16
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --use-distributed-optimizer)
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --image-token-index "${IMAGE_TOKEN_INDEX:?set IMAGE_TOKEN_INDEX}")
else
    [[ -f "$SYNTH_DIR/train.jsonl" ]] || python tools/make_image_text_set.py --output "$SYNTH_DIR" \
        --samples 2048 --size 336 --vocab-size 128256
    DATA_ARGS=(--data-path "$SYNTH_DIR/train.jsonl" --split 98,2,0 --tokenizer-type NullTokenizer
               --vocab-size 128256 --image-token-index 128254)
fi
DATA_ARGS+=(--num-workers ${NUM_WORKERS:-8})
OUTPUT_ARGS=(--log-interval 10 --log-throughput --eval-interval 100 --eval-iters 5 ${LOAD:+--load "$LOAD"})

torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain_vlm.py \
    "${MODEL_ARGS[@]}" "${VISION_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
