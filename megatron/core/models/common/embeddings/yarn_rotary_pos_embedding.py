"""YaRN rotary embedding (Peng et al. 2023, as used by DeepSeek-V2/V3): RoPE stretched for long context.

Each frequency theta_i = base^(-2i/d) is blended between itself ("extrapolation", high frequencies that
turn many times within the original context) and theta_i / factor ("interpolation", low frequencies).
The blend is a linear ramp over the dims whose number of turns within ``original_max_position_embeddings``
lies between ``beta_slow`` and ``beta_fast``. The attention logits are then sharpened by the mscale
("concentration") factor, which callers apply to cos/sin; MLA also squares it into the softmax scale.
"""
import math
from typing import Tuple

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def _yarn_find_correction_dim(num_rotations: float, dim: int, rotary_base: float, max_position_embeddings: int):
    """The (fractional) dim index 2i/2 whose frequency turns ``num_rotations`` times over the context."""
    return dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(rotary_base))


def _yarn_find_correction_range(beta_fast: float, beta_slow: float, dim: int, rotary_base: float,
                                max_position_embeddings: int, round_to_int: bool = True):
    """[low, high] dim indices of the ramp (clamped to [0, dim - 1])."""
    low = _yarn_find_correction_dim(beta_fast, dim, rotary_base, max_position_embeddings)
    high = _yarn_find_correction_dim(beta_slow, dim, rotary_base, max_position_embeddings)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_linear_ramp_mask(low: float, high: float, n: int, device=None) -> torch.Tensor:
    """0 below ``low``, 1 above ``high``, linear in between, over ``n`` frequency slots."""
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = (torch.arange(n, dtype=torch.float32, device=device) - low) / (high - low)
    return ramp.clamp(0, 1)


def _yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_get_concentration_factor(scaling_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """Factor on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    return _yarn_get_mscale(scaling_factor, mscale) / _yarn_get_mscale(scaling_factor, mscale_all_dim)


def yarn_inv_freq(dim: int, rotary_base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, round_to_int: bool = True, device=None) -> torch.Tensor:
    """The blended inverse frequencies [dim / 2] in fp32."""
    extrapolation = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    interpolation = extrapolation / scaling_factor
    low, high = _yarn_find_correction_range(beta_fast, beta_slow, dim, rotary_base,
                                            original_max_position_embeddings, round_to_int)
    keep = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device=device)  # 1: keep the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE with YaRN frequencies; ``forward`` returns ``(emb [s, 1, 1, d], mscale)`` as Megatron's does."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor=None, rotary_base: float = 10000.0,
                 use_cpu_initialization: bool = False, scaling_factor: float = 1.0,
                 original_max_position_embeddings: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 mscale: float = 1.0, mscale_all_dim: float = 0.0, correction_range_round_to_int: bool = True,
                 cp_group=None):
        if rotary_interleaved:
            raise ValueError("YaRN rotary embeddings do not support --rotary-interleaved")
        super().__init__(kv_channels, rotary_percent, rotary_interleaved=False,
                         seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                         use_cpu_initialization=use_cpu_initialization)
        dim = int(kv_channels * rotary_percent)
        self.scaling_factor = scaling_factor
        self.mscale = _yarn_get_concentration_factor(scaling_factor, mscale, mscale_all_dim)
        inv_freq = yarn_inv_freq(dim, rotary_base, scaling_factor, original_max_position_embeddings, beta_fast,
                                 beta_slow, correction_range_round_to_int, device=self.inv_freq.device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> Tuple[torch.Tensor, float]:
        return super().forward(max_seq_len, offset, packed_seq), self.mscale
