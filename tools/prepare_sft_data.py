"""Check and pre-tokenize a JSONL file of chat conversations for `pretrain_gpt.py --sft`.

    python tools/prepare_sft_data.py --input chats.jsonl --output chats.npz \
        --tokenizer-model HF_TOKENIZER_DIR --sft-tokenizer-prompt-format default --seq-length 4096 \
        [--sft-bad-records skip]

Every bad record prints one line `file:line: what is wrong` (not JSON, no 'messages', an unknown role, no
assistant turn, a chat-template error, longer than --seq-length). `--sft-bad-records stop` (the default)
exits at the first one with status 1 and writes nothing; `skip` drops each and writes the rest. The output
is written to a temporary file and renamed when complete, so it is never half-written. Pass it to training
as `--data-path chats.npz` with the same tokenizer and prompt format.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.datasets.sft_chat import (  # noqa: E402
    PROMPT_FORMATS,
    ChatFormat,
    load_hf_tokenizer,
    read_chat_template,
)
from megatron.training.datasets.sft_conversations import BadRecordError, save_npz, tokenize_jsonl  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="JSONL file: one {\"messages\": [{role, content}, ...]} per line.")
    p.add_argument("--output", required=True, help="The .npz to write (give it to --data-path).")
    p.add_argument("--tokenizer-model", required=True, help="Local Hugging Face tokenizer directory.")
    p.add_argument("--sft-tokenizer-prompt-format", default="default", choices=sorted(PROMPT_FORMATS),
                   help="default: the tokenizer's own chat template.")
    p.add_argument("--chat-template", default=None,
                   help="A Jinja chat template (or a file holding one) instead of the prompt format's.")
    p.add_argument("--seq-length", type=int, default=None, help="Refuse conversations longer than this + 1 tokens.")
    p.add_argument("--sft-bad-records", default="stop", choices=["stop", "skip"],
                   help="Stop at the first bad record (write nothing) or skip each one.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if not args.output.endswith(".npz"):
        sys.exit(f"error: --output {args.output}: name it *.npz (training recognizes the prepared file by it)")
    if not os.path.isfile(args.input):
        sys.exit(f"error: --input {args.input}: no such file")
    try:
        chat = ChatFormat(load_hf_tokenizer(args.tokenizer_model), args.sft_tokenizer_prompt_format,
                          args.tokenizer_model, read_chat_template(args.chat_template))
        data = tokenize_jsonl(args.input, chat, args.seq_length, args.sft_bad_records,
                              report=lambda line: print(line, file=sys.stderr, flush=True))
    except (BadRecordError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    save_npz(data, args.output)
    print(f"wrote {args.output}: {len(data)} conversations, {len(data.tokens)} tokens "
          f"({int(data.mask.sum())} trained), {data.meta['skipped']} bad records skipped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
