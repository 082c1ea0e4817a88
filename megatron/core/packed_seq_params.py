"""Boundaries of the sequences packed into one `thd` row, as attention and RoPE kernels read them."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class PackedSeqParams:
    """Cumulative sequence lengths (`cu_seqlens_*`, int32, starting at 0) of a packed batch.

    The `_padded` variants include per-sequence padding (context parallel needs lengths divisible by
    2 * cp); `seq_idx` maps every token to its sequence and is derived when `total_tokens` is given.
    """

    qkv_format: str = None
    cu_seqlens_q: Tensor = None
    cu_seqlens_kv: Tensor = None
    cu_seqlens_q_padded: Tensor = None
    cu_seqlens_kv_padded: Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: dist.ProcessGroup = None
    total_tokens: int = None
    seq_idx: Tensor = None
    tokens_per_sample: int = None
    pad_between_seqs: bool = None

    def __post_init__(self):
        cu = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
        if isinstance(cu, Tensor) and self.total_tokens is not None:
            # [0, 5, 7, 11] with 16 tokens -> lengths [5, 2, 4, 5] -> [0]*5 + [1]*2 + [2]*4 + [3]*5:
            # tokens after the last boundary form one more sequence. Lengths are clamped at 0 because
            # padded boundaries may exceed total_tokens on a context-parallel slice.
            bounds = torch.cat([cu, cu.new_tensor([self.total_tokens])])
            lengths = (bounds[1:] - bounds[:-1]).clamp(min=0)
            idx = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
            self.seq_idx = idx.to(torch.int32).unsqueeze(0)  # [1, total_tokens]
