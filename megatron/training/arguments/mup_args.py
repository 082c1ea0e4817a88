"""Megatron's MuP flags (--use-mup and its multipliers; megatron/core/transformer/mup.py has the rules)."""
from megatron.core.transformer.mup import check_mup


def add_mup_args(parser):
    g = parser.add_argument_group(title="maximal update parameterization")
    g.add_argument("--use-mup", action="store_true",
                   help="Maximal Update Parameterization: hyperparameters tuned at --mup-base-hidden-size transfer to "
                        "this width (attention 1/d, logits / width multiplier, hidden init and Adam LR and eps / "
                        "width multiplier).")
    g.add_argument("--mup-width-mult", type=float, default=1.0,
                   help="Computed as --hidden-size / --mup-base-hidden-size (set that instead).")
    g.add_argument("--mup-base-hidden-size", type=int, default=None,
                   help="Hidden size of the base model the hyperparameters were tuned on (default --hidden-size).")
    g.add_argument("--mup-embedding-mult", type=float, default=1.0, help="Multiplier of the embeddings' output.")
    g.add_argument("--mup-output-mult", type=float, default=1.0,
                   help="Multiplier of the logits (at 1.0 under MuP: 1 / width multiplier).")
    g.add_argument("--mup-base-head-dim", type=float, default=None,
                   help="Base head size: the attention scale is sqrt(it) / d^power, the base model's usual scale.")
    g.add_argument("--mup-attn-scale-power", type=float, default=1.0,
                   help="Attention scale 1 / d^power: 1.0 MuP's, 0.5 the standard one.")
    return parser


def validate_mup_args(args, require):
    if not args.use_mup:
        for flag, name, default in (("--mup-base-hidden-size", "mup_base_hidden_size", None),
                                    ("--mup-embedding-mult", "mup_embedding_mult", 1.0),
                                    ("--mup-output-mult", "mup_output_mult", 1.0),
                                    ("--mup-base-head-dim", "mup_base_head_dim", None),
                                    ("--mup-attn-scale-power", "mup_attn_scale_power", 1.0)):
            require(getattr(args, name) == default, f"{flag} applies with --use-mup only: add it or drop the flag")
    try:
        check_mup(args)
    except ValueError as e:
        require(False, str(e))


def refuse_mup(args, script):
    """Entry points whose models do not apply MuP's logit multiplier refuse --use-mup with one line."""
    if getattr(args, "use_mup", False):
        raise ValueError(f"{script}: --use-mup is built for GPT and hybrid models (pretrain_gpt.py, "
                         f"pretrain_hybrid.py)")
