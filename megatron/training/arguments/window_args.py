"""--window-size: sliding-window attention (Mistral), with Megatron's (left, right) semantics."""


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
    return parser


def validate_window_args(args, require):
    w = args.window_size
    if w is None:
        return
    require(len(w) == 2 and all(x >= -1 for x in w),
            f"--window-size {w}: pass two integers left,right (each >= 0, or -1 for unbounded)")
