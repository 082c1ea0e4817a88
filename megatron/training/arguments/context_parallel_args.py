"""Flags of context parallelism and packed-document attention, and their validation."""


def add_context_parallel_args(parser):
    g = parser.add_argument_group(title="context parallel")
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                   help="How attention exchanges K/V over the CP group: p2p (ring), allgather, a2a "
                        "(head all-to-all); one value, or one per layer. a2a+p2p is not supported.")
    return parser


def validate_context_parallel_args(args, require, warn):
    """One-line errors for CP layouts attention cannot run; picks per-document attention for
    --reset-attention-mask (document offsets instead of a dense [s, s] mask)."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    types = [t.replace("all_gather", "allgather") for t in args.cp_comm_type]
    args.cp_comm_type = types
    require(len(types) in (1, args.num_layers),
            f"--cp-comm-type has {len(types)} values; give one, or one per layer (--num-layers {args.num_layers})")
    for t in types:
        require(t != "a2a+p2p", "--cp-comm-type a2a+p2p (hierarchical CP) is not supported; use p2p, allgather or a2a")
        require(t in ("p2p", "allgather", "a2a"), f"--cp-comm-type '{t}' unknown; use p2p, allgather or a2a")
    if cp > 1:
        split = 2 * cp * (tp if args.sequence_parallel else 1)
        require(args.seq_length % split == 0,
                f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size ({cp})"
                + (f" x --tensor-model-parallel-size ({tp}) with --sequence-parallel"
                   if args.sequence_parallel else ""))
        require(args.attention_backend not in ("unfused", "fused"),
                f"--attention-backend {args.attention_backend} has no log-sum-exp path here, which "
                "--context-parallel-size > 1 needs to merge partial attention; use auto or flash")
        require(args.attention_dropout == 0,
                "--context-parallel-size > 1 runs attention without dropout; pass --attention-dropout 0")
        heads = args.num_attention_heads // tp
        require("a2a" not in types or heads % cp == 0,
                f"--cp-comm-type a2a splits the {heads} attention heads per TP rank over --context-parallel-size "
                f"({cp}), which must divide them; use p2p or allgather")
    if args.sft:
        return  # validate_sft_args: SFT samples always carry document offsets
    if not args.reset_attention_mask:
        # Megatron's loader builds a plain causal [s, s] mask per sample by default; our attention is causal
        # without it. At long sequences that mask alone (s^2 bytes: 16 GiB at 128k) kills the loader workers.
        mask_bytes = args.seq_length ** 2 * args.micro_batch_size
        require(not args.create_attention_mask_in_dataloader or mask_bytes < 2 ** 32,
                f"--seq-length {args.seq_length} makes the data loader build a {mask_bytes / 2 ** 30:.0f} GiB "
                "[s, s] attention mask per micro-batch, which attention here never needs; pass "
                "--no-create-attention-mask-in-dataloader")
        return
    if args.attention_dropout == 0 or cp > 1:
        args.create_attention_mask_in_dataloader = False  # samples carry cu_seqlens
    elif not args.create_attention_mask_in_dataloader:
        require(False, "--reset-attention-mask with --no-create-attention-mask-in-dataloader runs per-document "
                       "attention without dropout; pass --attention-dropout 0")
    else:
        warn(args, "--reset-attention-mask with --attention-dropout > 0 uses a dense [s, s] mask per sample; "
                   "pass --attention-dropout 0 for per-document attention")
