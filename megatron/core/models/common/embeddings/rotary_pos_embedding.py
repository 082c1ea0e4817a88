"""Rotary position embedding frequencies (RoPE)."""
import math
from typing import List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.context_parallel.utils import cp_local_indices
from megatron.core.utils import get_device


class RotaryEmbedding(torch.nn.Module):
    """theta_i = base^(-2i/d) over the first ``rotary_percent`` of each head's channels."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0, use_cpu_initialization: bool = False,
                 cp_group=None):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim % 2 != 0:
            raise ValueError(f"kv_channels * rotary_percent = {dim} must be even")
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        device = torch.device("cpu") if use_cpu_initialization else get_device()
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if rope_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        """Device moves apply, dtype casts do not: Float16Module casts the model to bf16, and a bf16 inv_freq
        is off by up to 0.4%, i.e. whole radians of angle after a few hundred positions."""
        fp32 = self.inv_freq
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = fp32.to(self.inv_freq.device)
        return self

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = torch.outer(seq, self.inv_freq)  # [s, d/2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [s, d]: f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [s, d]: f0 f1 ... f0 f1 ...
        return emb[:, None, None, :]  # [s, 1, 1, d]

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, tp_size: Optional[int] = None) -> int:
        """Full sequence length seen by attention (undoing the SP and CP splits of the block input).
        ``tp_size``: the SP split of a model on explicit groups (parallel_state's TP size when None)."""
        if transformer is not None and transformer.input_tensor is not None:
            seq_len = transformer.input_tensor.size(0)
        else:
            seq_len = transformer_input.size(0)
        if transformer_config.sequence_parallel:
            seq_len *= parallel_state.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        return seq_len * transformer_config.context_parallel_size  # CP ranks hold 1/CP of the sequence


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (mRoPE, Qwen2-VL): each token has a (temporal, height, width) position, and the
    rotary channels are split into ``mrope_section`` = [t, h, w] frequency bands (sum: rot_dim / 2),
    band k rotating by position component k. Text tokens, with t = h = w, get plain RoPE.

    ``forward(position_ids [3, b, s], mrope_section)`` returns angles ``[s, b, 1, rot_dim]`` for
    ``apply_rotary_pos_emb``; with a context-parallel group of > 1 rank, this rank's two sequence
    chunks (the causal load-balanced layout of the CP attention)."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000,
                 cp_group=None) -> None:
        super().__init__(kv_channels, rotary_percent, rotary_interleaved=rotary_interleaved,
                         seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base)
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group(
            check_initialized=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: List[int], cp_group=None) -> torch.Tensor:
        half = self.inv_freq.numel()
        if position_ids.dim() != 3 or position_ids.size(0) != 3:
            raise ValueError(f"mRoPE position_ids must be [3, batch, seq], got {tuple(position_ids.shape)}")
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to rot_dim / 2 = {half}")
        seq = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = seq[..., None] * self.inv_freq  # [3, b, s, rot_dim / 2]
        # Frequency band j takes its angle from position component section_of(j).
        section = torch.repeat_interleave(torch.arange(3, device=freqs.device),
                                          torch.tensor(list(mrope_section), device=freqs.device))
        freqs = freqs.gather(0, section.expand(1, *freqs.shape[1:-1], half)).squeeze(0)  # [b, s, rot_dim / 2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...
        emb = emb.transpose(0, 1)[:, :, None, :].contiguous()  # [s, b, 1, rot_dim]
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = emb.index_select(0, cp_local_indices(emb.size(0), cp_group.size(), cp_group.rank(), emb.device))
        return emb


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, original_max_position: int = 8192) -> torch.Tensor:
    """Llama 3.1 RoPE scaling (``--use-rope-scaling``): wavelengths longer than original/low_freq_factor
    are stretched by ``factor``, shorter than original/high_freq_factor kept, and the band between
    blended linearly in original/wavelength. Same arithmetic order as Hugging Face's ``llama3`` rope."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_max_position / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (~(wavelen < original_max_position / high_freq_factor)
              * ~(wavelen > original_max_position / low_freq_factor))
    return torch.where(medium, blended, scaled)
