#!/usr/bin/env bash
# Supervised fine-tuning of a Llama-3-8B-shaped model on one node of 8 GPUs (TP=2 x DP=4, bf16, the
# distributed optimizer): HF import -> conversation check -> pretrain_gpt.py --sft (packed 4k sequences,
# loss on assistant turns) -> HF export -> generation. ~10 min for the import and first log lines, then
# ~1 s per step on H100s.
#
#   HF_MODEL=/models/Llama-3.1-8B-Instruct DATA=/data/chats.jsonl bash examples/sft/sft_llama3_8b.sh
#   GPUS_PER_NODE=2 TP=2 ... bash examples/sft/sft_llama3_8b.sh --train-iters 20   (a quick trial)
# HF_MODEL is a local Hugging Face directory (config.json, *.safetensors, tokenizer.json with a chat
# template); DATA is JSONL, one {"messages": [{"role": ..., "content": ...}, ...]} per line.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

HF_MODEL=${HF_MODEL:-${1:-/models/Llama-3.1-8B-Instruct}}
DATA=${DATA:-${2:-/data/chats.jsonl}}
WORK=${WORK:-checkpoints/llama3_8b_sft}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-2}
SEQ=${SEQ:-4096}

python tools/checkpoint/hf.py import --hf-model-path "$HF_MODEL" --output-path "$WORK/imported" --tp "$TP"
python tools/prepare_sft_data.py --input "$DATA" --output "$WORK/chats.npz" --tokenizer-model "$WORK/imported" \
    --sft-tokenizer-prompt-format default --seq-length "$SEQ" --sft-bad-records skip

MODEL_ARGS=(  # Llama-3-8B; = $WORK/imported/model_args.sh
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --max-position-embeddings 131072 --position-embedding-type rope --rotary-base 500000
    --use-rope-scaling --rope-scaling-factor 8.0
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights
    --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
)
SFT_ARGS=(
    --sft --sft-tokenizer-prompt-format default --data-path "$WORK/chats.npz" --split 98,2,0
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/imported"
    --pretrained-checkpoint "$WORK/imported" --load "$WORK/sft" --save "$WORK/sft" --save-interval 500
    --seq-length "$SEQ" --micro-batch-size 1 --global-batch-size 64   # 64 x 4096 = 262k tokens per step
    --train-iters 2000 --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50
    --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16 --cross-entropy-loss-fusion
    --tensor-model-parallel-size "$TP" --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
    --log-interval 1 --log-throughput --eval-interval 200 --eval-iters 10
)
torchrun --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py "${MODEL_ARGS[@]}" "${SFT_ARGS[@]}" "$@"

python tools/checkpoint/hf.py export --checkpoint-path "$WORK/sft" --output-path "$WORK/hf_sft"
PROMPT=$(python -c "import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); \
print(t.apply_chat_template([{'role': 'user', 'content': 'Name three prime numbers.'}], tokenize=False, add_generation_prompt=True), end='')" "$HF_MODEL"; echo x)
PROMPT=${PROMPT%x}
python -m torch.distributed.run --nproc-per-node "$TP" tools/generate.py --load "$WORK/sft" --use-checkpoint-args \
    --tokenizer-model "$WORK/imported" --tensor-model-parallel-size "$TP" --num-tokens-to-generate 64 --prompt "$PROMPT"
