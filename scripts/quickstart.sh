#!/usr/bin/env bash
# Quick start: install the dependencies, tokenize the shipped corpus (data/) into .bin/.idx files under
# data/processed/ (gitignored), train a small GPT on CPU with pretrain_gpt.py and print its log, then
# print a short sample from the checkpoint it saved (tools/generate.py; to serve a checkpoint with
# tools/run_text_generation_server.py, see docs/inference.md).
# On 2 CPU cores: ~10 s preprocessing, 1-4 min training (idle vs busy cores); lm loss ~9.0 -> ~6.3.
#
# Environment knobs: PYTHON (interpreter, default python3), NPROC (processes; >1 launches torchrun with
# gloo on CPU, or NCCL when CUDA is present), TRAIN_ITERS (default 150), QUICKSTART_DIR (output folder,
# default data/processed), SKIP_INSTALL=1 (keep the current packages as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NPROC=${NPROC:-1}
TRAIN_ITERS=${TRAIN_ITERS:-150}
OUT=${QUICKSTART_DIR:-data/processed}
PREFIX=$OUT/corpus_text_document
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file data/vocab.json --merge-file data/merges.txt)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  echo "== 1/4 installing dependencies (scripts/install_deps.sh)"
  PYTHON=$PY bash scripts/install_deps.sh
fi

echo "== 2/4 tokenizing data/corpus.jsonl.gz -> $PREFIX.{bin,idx}"
if [[ -f $PREFIX.bin && -f $PREFIX.idx ]]; then
  echo "   already there; delete $OUT to redo"
else
  mkdir -p "$OUT"
  $PY tools/preprocess_data.py --input data/corpus.jsonl.gz --output-prefix "$OUT/corpus" \
      "${TOKENIZER[@]}" --append-eod --workers 2 --log-interval 2000
fi

echo "== 3/4 training a 2-layer GPT for $TRAIN_ITERS iterations on $NPROC process(es)"
if [[ $NPROC -gt 1 ]]; then
  LAUNCH=($PY -m torch.distributed.run --nproc-per-node "$NPROC")
else
  LAUNCH=($PY)
fi
LOG=$OUT/quickstart_train.log
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "${LAUNCH[@]}" pretrain_gpt.py \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
    --data-path "$PREFIX" --split 98,2,0 "${TOKENIZER[@]}" \
    --log-interval 10 --eval-interval "$TRAIN_ITERS" --eval-iters 5 --num-workers 0 \
    --save "$OUT/checkpoint" --save-interval "$TRAIN_ITERS" 2>&1 | tee "$LOG"

# The first and last reported training loss, so the drop is plain to see.
$PY - "$LOG" <<'EOF'
import re, sys
losses = [float(m) for m in re.findall(r"\| lm loss: (\S+) \|", open(sys.argv[1]).read())]
if len(losses) < 2:
    sys.exit(f"quickstart: expected training log lines in {sys.argv[1]}, found {len(losses)}")
print(f"\nquickstart: lm loss {losses[0]:.2f} -> {losses[-1]:.2f} "
      f"({'falling, as it should' if losses[-1] < losses[0] else 'NOT falling: see docs/troubleshooting.md'})")
sys.exit(0 if losses[-1] < losses[0] else 1)
EOF

# A few dozen tokens from the model just trained (seeded sampling; a few seconds on CPU).
echo "== 4/4 a sample from $OUT/checkpoint (tools/generate.py)"
SAMPLE_LOG=$OUT/quickstart_sample.log
if ! OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} $PY tools/generate.py --load "$OUT/checkpoint" --use-checkpoint-args \
    "${TOKENIZER[@]}" --prompt "Return the" --num-tokens-to-generate 40 --temperature 0.8 --top_k 40 \
    --seed 1234 > "$SAMPLE_LOG" 2>&1; then
  tail -n 20 "$SAMPLE_LOG"
  exit 1
fi
sed -n '/^=== prompt/,$p' "$SAMPLE_LOG"
