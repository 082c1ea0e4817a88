"""Flags of context parallelism and packed-document attention, and their validation."""


def add_context_parallel_args(parser):
    g = parser.add_argument_group(title="context parallel")
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                   help="How attention exchanges K/V over the CP group: p2p (ring), allgather, a2a "
                        "(head all-to-all), a2a+p2p (all-to-all inside, ring across; needs "
                        "--hierarchical-context-parallel-sizes); one value, or one per layer.")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="The CP group split in levels, product = --context-parallel-size; for --cp-comm-type "
                        "a2a+p2p two values: the all-to-all size (consecutive CP ranks: one node's GPUs), then "
                        "the ring size across those groups (2 4 at CP=8).")
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
        require(t in ("p2p", "allgather", "a2a", "a2a+p2p"),
                f"--cp-comm-type '{t}' unknown; use p2p, allgather, a2a or a2a+p2p")
    _validate_hierarchical(args, types, require)
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
        # Megatron's loader builds a plain causal [s, s] mask per sample by default; attention here is causal
        # without it and get_batch never reads it. Building it anyway costs the loader worker, the shared-memory
        # hand-off and the pinned copy s^2 bytes per sample (16 MiB at 4k: the loader, not the GPU, then sets
        # the pace of a short iteration; 16 GiB at 128k kills the workers), so it is not built.
        args.create_attention_mask_in_dataloader = False
        return
    if args.attention_dropout == 0 or cp > 1:
        args.create_attention_mask_in_dataloader = False  # samples carry cu_seqlens
    elif not args.create_attention_mask_in_dataloader:
        require(False, "--reset-attention-mask with --no-create-attention-mask-in-dataloader runs per-document "
                       "attention without dropout; pass --attention-dropout 0")
    else:
        warn(args, "--reset-attention-mask with --attention-dropout > 0 uses a dense [s, s] mask per sample; "
                   "pass --attention-dropout 0 for per-document attention")


def _validate_hierarchical(args, types, require):
    """--hierarchical-context-parallel-sizes splits CP into levels; a2a+p2p reads two: [a2a size, ring size]."""
    sizes, cp = args.hierarchical_context_parallel_sizes, args.context_parallel_size
    hierarchical = "a2a+p2p" in types
    require(not hierarchical or sizes is not None,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (all-to-all size, ring size; "
            "A x P = --context-parallel-size)")
    if sizes is None:
        return
    product = 1
    for x in sizes:
        product *= x
    require(min(sizes) >= 1 and product == cp,
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be positive and multiply to "
            f"--context-parallel-size ({cp})")
    if not hierarchical:
        return
    require(len(sizes) == 2, f"--cp-comm-type a2a+p2p takes two --hierarchical-context-parallel-sizes (all-to-all "
                             f"size, ring size), got {len(sizes)}")
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    require(heads % sizes[0] == 0,
            f"--cp-comm-type a2a+p2p splits the {heads} attention heads per TP rank over the all-to-all size "
            f"{sizes[0]} (first --hierarchical-context-parallel-sizes value), which must divide them; use a "
            "smaller first size or p2p")
