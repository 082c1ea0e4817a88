"""Two flags of Megatron's ModelOpt (post-training) argument group that its gpt-oss launch script passes to
pretrain_gpt.py. Megatron registers them only when nvidia-modelopt is installed and reads them only in ModelOpt's
model builder (a ModelOpt checkpoint under --load); a model trained from the flags does not read them."""


def add_modelopt_args(parser):
    g = parser.add_argument_group(title="ModelOpt export flags (gpt-oss script)")
    g.add_argument("--export-force-local-attention", action="store_true",
                   help="ModelOpt: build local DotProductAttention instead of Transformer Engine's; attention here "
                        "is always this project's own torch attention.")
    g.add_argument("--enable-gpt-oss", action="store_true",
                   help="ModelOpt: give a ModelOpt-built gpt-oss model YaRN RoPE; no effect on a model built from the "
                        "flags (pass --position-embedding-type yarn with the --yarn-* flags).")
    return parser


def report_modelopt_args(args, say):
    """One start-up line per flag that has no effect here."""
    if args.export_force_local_attention:
        say("--export-force-local-attention has no effect here (same result): attention is always the local torch "
            "attention")
    if args.enable_gpt_oss:
        say("--enable-gpt-oss has no effect here: Megatron reads it in ModelOpt's model builder only (ModelOpt "
            "checkpoints); for gpt-oss's YaRN pass --position-embedding-type yarn and the --yarn-* flags")
