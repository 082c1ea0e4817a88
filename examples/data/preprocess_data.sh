#!/usr/bin/env bash
# Data preparation: tokenize JSON lines into Megatron's .bin/.idx pair with tools/preprocess_data.py.
# Defaults tokenize the shipped corpus (data/corpus.jsonl.gz, 1.9 MB) with the shipped GPT-2-style BPE
# into data/processed/corpus_text_document.{bin,idx}: ~10 s on 2 cores. The result is what --data-path
# takes (the prefix, without .bin/.idx).
#
#   bash examples/data/preprocess_data.sh
#   INPUT=/data/owt.jsonl OUTPUT_PREFIX=/data/owt VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt WORKERS=32 \
#       bash examples/data/preprocess_data.sh
# Other tokenizers: --tokenizer-type HuggingFaceTokenizer --tokenizer-model <tokenizer.json or dir>,
# SentencePieceTokenizer / Llama2Tokenizer --tokenizer-model <file.model>, TikTokenizer --tokenizer-model <file>.
# Several outputs combine with: python tools/merge_datasets.py --input <dir> --output-prefix <prefix>
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

INPUT=${INPUT:-data/corpus.jsonl.gz}
OUTPUT_PREFIX=${OUTPUT_PREFIX:-data/processed/corpus}
VOCAB_FILE=${VOCAB_FILE:-data/vocab.json}
MERGE_FILE=${MERGE_FILE:-data/merges.txt}
WORKERS=${WORKERS:-2}

mkdir -p "$(dirname "$OUTPUT_PREFIX")"
python tools/preprocess_data.py \
    --input "$INPUT" --json-keys text --output-prefix "$OUTPUT_PREFIX" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --append-eod --workers "$WORKERS" --log-interval 2000
echo "wrote ${OUTPUT_PREFIX}_text_document.bin/.idx; train with --data-path ${OUTPUT_PREFIX}_text_document"
