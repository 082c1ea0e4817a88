#!/usr/bin/env bash
# Supervised fine-tuning end to end on a tiny random Llama, CPU, ~2 min: Hugging Face import ->
# conversation check and pre-tokenization -> pretrain_gpt.py --sft (packed conversations, loss on the
# assistant turns) -> Hugging Face export -> generation from the fine-tuned checkpoint.
#
#   bash examples/sft/sft_tiny_cpu.sh            (writes under OUT, default /tmp/sft_tiny)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${OUT:-/tmp/sft_tiny}
rm -rf "$OUT" && mkdir -p "$OUT"

# 1. a tiny HF model with a chat template (stands in for e.g. meta-llama/Llama-3.1-8B-Instruct) + data
python examples/sft/make_tiny_model.py --output "$OUT"
# 2. HF -> our torch_dist checkpoint (tokenizer files and the chat template are copied along)
python tools/checkpoint/hf.py import --hf-model-path "$OUT/hf" --output-path "$OUT/imported"
# 3. check every conversation and pre-tokenize it (one file:line per bad record; nothing half-written)
python tools/prepare_sft_data.py --input "$OUT/chats.jsonl" --output "$OUT/chats.npz" \
    --tokenizer-model "$OUT/imported" --sft-tokenizer-prompt-format default --seq-length 256
# 4. fine-tune: weights from --pretrained-checkpoint (iteration 0, fresh optimizer), saves to --save;
#    a restart with the same command resumes from --save mid-epoch
MODEL_ARGS=(  # = $OUT/imported/model_args.sh (or pass --use-checkpoint-args)
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16
    --group-query-attention --num-query-groups 2 --max-position-embeddings 256
    --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
)
python pretrain_gpt.py "${MODEL_ARGS[@]}" \
    --sft --sft-tokenizer-prompt-format default --data-path "$OUT/chats.npz" --split 95,5,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/imported" \
    --pretrained-checkpoint "$OUT/imported" --load "$OUT/sft" --save "$OUT/sft" --save-interval 20 \
    --seq-length 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 \
    --eval-interval 10 --eval-iters 2 --log-interval 5 --num-workers 0 "$@"
# 5. ours -> HF (config.json, safetensors, tokenizer + chat template): loads with AutoModelForCausalLM
python tools/checkpoint/hf.py export --checkpoint-path "$OUT/sft" --output-path "$OUT/hf_sft"
# 6. generate from the fine-tuned checkpoint with a chat-formatted prompt
PROMPT=$(python -c "import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); \
print(t.apply_chat_template([{'role': 'user', 'content': '12+30?'}], tokenize=False, add_generation_prompt=True), end='')" "$OUT/hf"; echo x)
PROMPT=${PROMPT%x}  # $(...) strips trailing newlines; the template's "\n\n" after the header must stay
python tools/generate.py --load "$OUT/sft" --use-checkpoint-args --tokenizer-model "$OUT/imported" \
    --num-tokens-to-generate 8 --prompt "$PROMPT"
