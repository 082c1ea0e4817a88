"""Which layers skip rotary position embeddings: Megatron's ``no_rope_freq`` (NoPE layers, as Llama 4 interleaves
them with RoPE layers).

An int N: every N-th layer (1-indexed, global over pipeline stages) skips RoPE, the other N - 1 apply it; the
layer count must be a multiple of N (Megatron's rule). A list of 0/1 per layer names them: 1 skips RoPE.
"""
from typing import List, Optional, Union


def no_rope_pattern(no_rope_freq: Union[int, List[int], None], num_layers: int) -> Optional[List[int]]:
    """The per-layer 0/1 list (1: no RoPE), or None when every layer applies RoPE; ValueError naming the flag when
    the pattern cannot be read as Megatron reads it."""
    if not no_rope_freq:
        return None
    if isinstance(no_rope_freq, int):
        if no_rope_freq < 1 or num_layers % no_rope_freq != 0:
            raise ValueError(f"--no-rope-freq {no_rope_freq}: the layer count ({num_layers}) must be a multiple of "
                             "it (every N-th layer skips RoPE)")
        return ([0] * (no_rope_freq - 1) + [1]) * (num_layers // no_rope_freq)
    pattern = [int(x) for x in no_rope_freq]
    if len(pattern) != num_layers or any(x not in (0, 1) for x in pattern):
        raise ValueError(f"--no-rope-freq: a list needs one 0/1 entry per layer ({num_layers}); got {pattern}")
    return pattern


def layer_skips_rope(no_rope_freq: Optional[List[int]], layer_number: int) -> bool:
    """True when layer ``layer_number`` (1-indexed, global) attends without RoPE."""
    return bool(no_rope_freq) and bool(no_rope_freq[layer_number - 1])
