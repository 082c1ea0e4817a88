"""--window-size: sliding-window attention (Mistral), with Megatron's (left, right) semantics;
--window-attn-skip-freq: the layers that use it (gpt-oss alternates windowed and full layers); --no-rope-freq: the
layers that attend without rotary embeddings (Llama 4's NoPE layers)."""
from megatron.core.transformer.attention_sinks import SOFTMAX_TYPES
from megatron.core.transformer.no_rope import no_rope_pattern
from megatron.core.transformer.window_attention import check_window_attn_skip_freq

from .types import no_rope_freq_type, window_attn_skip_freq_type


def tuple_type(value):
    """'4095,0' or '(4095, 0)' -> (4095, 0), as Megatron parses it."""
    if isinstance(value, tuple):
        return value
    return tuple(int(x) for x in value.strip("()[] ").split(","))


def add_window_args(parser):
    g = parser.add_argument_group(title="sliding window attention")
    g.add_argument("--window-size", type=tuple_type, default=None,
                   help="Attention window (left, right) in tokens, e.g. 4095,0: query i sees keys i-left..i+right "
                        "(-1: unbounded). Default: full attention.")
    g.add_argument("--softmax-type", type=str, default="vanilla", choices=list(SOFTMAX_TYPES),
                   help="Attention sinks (gpt-oss): off-by-one adds a sink logit 0 to each head's softmax "
                        "(softmax + 1 in the denominator), learnable one trained sink logit per head; the sink's "
                        "value is zero, so a head can attend to nothing.")
    g.add_argument("--window-attn-skip-freq", type=window_attn_skip_freq_type, default=None,
                   help="The layers --window-size leaves to full attention: N, every N-th layer (N-1 windowed "
                        "layers, then one full; 2 alternates), or a 0/1 list expression per layer such as "
                        "\"([1]*3+[0])*2\" (1: windowed). Default: every layer windowed.")
    g.add_argument("--no-rope-freq", type=no_rope_freq_type, default=None,
                   help="Layers that skip rotary position embeddings (NoPE, as Llama 4): N, every N-th layer (N-1 "
                        "RoPE layers, then one without; the layer count a multiple of N), or a 0/1 list expression "
                        "per layer (1: no RoPE).")
    return parser


def validate_window_args(args, require):
    if args.softmax_type != "vanilla":
        sinks = f"--softmax-type {args.softmax_type} (attention sinks)"
        require(args.context_parallel_size == 1, f"{sinks} is not supported with --context-parallel-size > 1 yet")
        require(not (args.reset_attention_mask or getattr(args, "sft", False)),
                f"{sinks} is not supported with packed sequences (--reset-attention-mask / --sft) yet")
    w = args.window_size
    try:
        check_window_attn_skip_freq(w, args.window_attn_skip_freq, args.num_layers)
        if args.no_rope_freq and args.num_layers is not None:
            no_rope_pattern(args.no_rope_freq, args.num_layers)
    except ValueError as e:
        require(False, str(e))
    if args.no_rope_freq:
        require(args.position_embedding_type in ("rope", "yarn", "mrope") and not args.multi_latent_attention,
                "--no-rope-freq picks the layers that skip RoPE: it needs --position-embedding-type rope (multi-latent "
                "attention keeps its own rotary embedding)")
    if w is None:
        return
    require(len(w) == 2 and all(x >= -1 for x in w),
            f"--window-size {w}: pass two integers left,right (each >= 0, or -1 for unbounded)")
