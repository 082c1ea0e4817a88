"""argparse `type=` converters of Megatron's flags."""
import ast

from megatron.core.utils import lazy_names


def _pattern(text: str):
    """A Python list expression of 0/1 such as "([1]*3+[0])*2" -> [1, 1, 1, 0, 1, 1, 1, 0]."""
    value = eval(text, {"__builtins__": {}}, {})  # literal arithmetic on lists only: no names available
    if not isinstance(value, list) or not all(v in (0, 1) for v in value):
        raise ValueError(f"layer pattern '{text}' must evaluate to a list of 0/1")
    return value


def _int_or_pattern(x, allow_none: bool):
    if (x is None and allow_none) or isinstance(x, int):
        return x
    return _pattern(x) if "[" in x else int(x)


def moe_freq_type(x):
    """--moe-layer-freq: N (one MoE layer every N layers) or a 0/1 list expression (1 = MoE layer)."""
    return _int_or_pattern(x, allow_none=False)


def no_rope_freq_type(x):
    """--no-rope-freq: N (skip RoPE every N-th layer) or a 0/1 list expression (1 = no RoPE)."""
    return _int_or_pattern(x, allow_none=True)


def window_attn_skip_freq_type(x):
    """--window-attn-skip-freq: N (every N-th layer attends fully) or a 0/1 list expression (1 = windowed layer)."""
    return _int_or_pattern(x, allow_none=True)


def la_freq_type(x):
    """Linear-attention layer frequency: N or a 0/1 list expression (1 = linear attention)."""
    return _int_or_pattern(x, allow_none=True)


def tuple_type(x):
    """"1,2,3" or "(1,2,3)" -> (1, 2, 3)."""
    if x is None or isinstance(x, tuple):
        return x
    value = ast.literal_eval(x if x.strip().startswith("(") else f"({x},)")
    return tuple(int(v) for v in value)


# parse_and_validate_args lived here; it is Megatron's entry and now lives in the compat room.
__getattr__ = lazy_names(__name__, {"parse_and_validate_args": "megatron.training._compat.arguments"})
