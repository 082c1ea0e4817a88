"""Which layers attend through the sliding window: Megatron's ``window_attn_skip_freq`` (gpt-oss alternates
windowed and full-attention layers).

``window_size`` alone windows every layer. With ``window_attn_skip_freq`` N (an int), every N-th layer (1-indexed,
global over pipeline stages) attends fully and the others through the window: N = 2 alternates, starting windowed.
A list of 0/1 per layer names them: 1 windowed, 0 full.
"""
from typing import List, Optional, Tuple, Union


def is_layer_window_attention(window_size: Optional[Tuple[int, int]], window_attn_skip_freq: Union[int, List[int],
                              None], layer_number: int) -> bool:
    """True when layer ``layer_number`` (1-indexed) attends through ``window_size``."""
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    return bool(window_attn_skip_freq[layer_number - 1])


def check_window_attn_skip_freq(window_size, window_attn_skip_freq, num_layers: int) -> None:
    """ValueError naming the flag when the pattern cannot be read as Megatron reads it."""
    if window_attn_skip_freq is None:
        return
    flag = "--window-attn-skip-freq"
    if window_size is None:
        raise ValueError(f"{flag} picks the layers that use the sliding window: it needs --window-size")
    if isinstance(window_attn_skip_freq, int):
        if window_attn_skip_freq < 1:
            raise ValueError(f"{flag} ({window_attn_skip_freq}) must be >= 1")
        return
    if not isinstance(window_attn_skip_freq, (list, tuple)) or any(v not in (0, 1) for v in window_attn_skip_freq):
        raise ValueError(f"{flag}: expected an int or a list of 0/1 (1: windowed layer), got {window_attn_skip_freq}")
    if len(window_attn_skip_freq) != num_layers:
        raise ValueError(f"{flag}: the pattern has {len(window_attn_skip_freq)} entries for {num_layers} layers "
                         "(--num-layers); give one per layer")
