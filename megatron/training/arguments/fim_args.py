"""--fim-data and its settings (Megatron 0.19's names and defaults): fill-in-the-middle GPT samples, read by
pretrain_gpt.py (and pretrain_hybrid.py, which shares its datasets) through GPTFIMDataset."""

# dest -> default of the settings that only --fim-data reads
FIM_SETTINGS = {"fim_rate": 0.5, "fim_spm_rate": 0.5, "fim_split_sample": None, "fim_fragment_rate": None,
                "fim_no_prefix": None, "fim_prefix_token": "<fim_prefix>", "fim_middle_token": "<fim_middle>",
                "fim_suffix_token": "<fim_suffix>", "fim_pad_token": "<fim_pad>", "fim_eod_token": "<|endoftext|>"}


def add_fim_args(parser):
    g = parser.add_argument_group(title="fill-in-the-middle data")
    g.add_argument("--fim-data", action="store_true",
                   help="Rewrite GPT samples into fill-in-the-middle order: each document is cut at two random "
                        "characters and laid out prefix-suffix-middle (PSM) or suffix-prefix-middle (SPM) around "
                        "the FIM tokens, which the tokenizer's vocabulary must hold.")
    g.add_argument("--fim-rate", type=float, default=0.5,
                   help="Probability that a document is rewritten into FIM order.")
    g.add_argument("--fim-spm-rate", type=float, default=0.5,
                   help="Probability that a rewritten document uses the SPM layout instead of PSM.")
    g.add_argument("--fim-split-sample", type=str, default=None,
                   help="A token (e.g. a file separator) that cuts a document chosen for FIM into fragments, each "
                        "rewritten with --fim-fragment-rate.")
    g.add_argument("--fim-fragment-rate", type=float, default=None,
                   help="Probability that each fragment is rewritten when --fim-split-sample cuts a document.")
    g.add_argument("--fim-no-prefix", type=str, default=None,
                   help="Leave documents (or fragments) whose text starts with this string unchanged.")
    g.add_argument("--fim-prefix-token", type=str, default="<fim_prefix>", help="FIM prefix token.")
    g.add_argument("--fim-middle-token", type=str, default="<fim_middle>", help="FIM middle token.")
    g.add_argument("--fim-suffix-token", type=str, default="<fim_suffix>", help="FIM suffix token.")
    g.add_argument("--fim-pad-token", type=str, default="<fim_pad>",
                   help="FIM pad token: fills a rewritten sample that came out shorter than the sequence.")
    g.add_argument("--fim-eod-token", type=str, default="<|endoftext|>",
                   help="The token that ends documents in the data: each document is rewritten on its own.")
    return parser


def validate_fim_args(args, require):
    """Rates are probabilities; the FIM settings need --fim-data, and --fim-data needs text documents (the
    tokenizer lookup of the FIM tokens happens when the dataset config is made, once a tokenizer exists)."""
    if not args.fim_data:
        for dest, default in FIM_SETTINGS.items():
            flag = "--" + dest.replace("_", "-")
            require(getattr(args, dest) == default, f"{flag} applies with --fim-data only: add --fim-data or drop it")
        return
    for dest in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(args, dest)
        flag = "--" + dest.replace("_", "-")
        require(value is None or 0.0 <= value <= 1.0, f"{flag} ({value}) must be a probability in [0, 1]")
    require(args.fim_split_sample is None or args.fim_fragment_rate is not None,
            "--fim-split-sample rewrites each fragment with --fim-fragment-rate: pass --fim-fragment-rate too")
    require(args.fim_fragment_rate is None or args.fim_split_sample is not None,
            "--fim-fragment-rate applies to the fragments of --fim-split-sample: pass --fim-split-sample too")
    require(not args.mock_data, "--fim-data rewrites the text of --data-path documents; --mock-data has no text "
                                "(as in Megatron): drop one")
    require(not args.sft, "--fim-data rewrites pretraining documents, not --sft conversations: drop one")
