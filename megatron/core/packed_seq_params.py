"""Document boundaries of packed sequences (Megatron's PackedSeqParams, same fields)."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PackedSeqParams:
    """``cu_seqlens_*``: int32 offsets of each document in the batch flattened sample by sample (THD
    order; with one sample this is Megatron's THD layout). ``cu_seqlens_*_padded`` (optional) gives the
    boundaries including each document's padding; attention then runs per padded document. Queries and
    keys share the boundaries in self-attention."""

    qkv_format: str = "thd"
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    local_cp_size: Optional[int] = None
    cp_group: Optional[object] = None
