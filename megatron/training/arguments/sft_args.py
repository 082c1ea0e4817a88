"""Flags of supervised fine-tuning on chat conversations (--sft), and their validation."""
import os

from megatron.training.datasets.sft_chat import PROMPT_FORMATS

SFT_TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer")


def add_sft_args(parser):
    g = parser.add_argument_group(title="sft")
    g.add_argument("--sft", action="store_true",
                   help="Supervised fine-tuning: --data-path names JSONL conversations (or the .npz of "
                        "tools/prepare_sft_data.py), rendered with a chat template, loss on assistant tokens, "
                        "packed into --seq-length with per-conversation attention.")
    g.add_argument("--sft-tokenizer-prompt-format", type=str, default="nemotron-h-aligned",
                   help="SFT prompt format: default (the tokenizer's own chat template), identity, "
                        "nemotron-h-aligned, nemotron-nano-v2.")
    g.add_argument("--chat-template", type=str, default=None,
                   help="A Jinja chat template (or a file holding one) that renders the --sft conversations instead "
                        "of --sft-tokenizer-prompt-format's.")
    g.add_argument("--sft-bad-records", type=str, default="stop", choices=["stop", "skip"],
                   help="A bad conversation (no assistant turn, unknown role, longer than --seq-length, template "
                        "error): stop at the first one, or skip each (one line per record: file:line: what).")
    return parser


def validate_sft_args(args, require):
    """--sft reads conversations with an HF tokenizer and runs per-document attention (no dense mask)."""
    require(args.chat_template is None or args.sft, "--chat-template renders --sft conversations: add --sft")
    if not args.sft:
        return
    require(args.sft_tokenizer_prompt_format in PROMPT_FORMATS,
            f"--sft-tokenizer-prompt-format {args.sft_tokenizer_prompt_format!r} is unknown; choose one of "
            f"{', '.join(PROMPT_FORMATS)}")
    require(args.tokenizer_type in SFT_TOKENIZERS,
            f"--sft renders conversations with a Hugging Face tokenizer; pass --tokenizer-type HuggingFaceTokenizer "
            f"(or SFTTokenizer) and --tokenizer-model DIR, not {args.tokenizer_type}")
    require(args.tokenizer_model is not None and os.path.exists(args.tokenizer_model),
            f"--sft needs --tokenizer-model DIR, a local Hugging Face tokenizer directory (got {args.tokenizer_model})")
    require(not args.mock_data, "--sft reads conversations from --data-path; drop --mock-data")
    require(args.attention_dropout == 0,
            "--sft attends within each packed conversation without a dense mask, which runs without attention "
            "dropout; pass --attention-dropout 0")
    args.create_attention_mask_in_dataloader = False  # samples carry cu_seqlens
