"""The causal load balance of context parallelism and the per-token metadata that follows it.

The sequence is cut into 2 x CP chunks and CP rank r keeps chunks r and 2CP-1-r (Megatron's layout):
under a causal mask every rank then does the same amount of attention work.
"""
from typing import Dict, Optional

import torch

from megatron.core import parallel_state

CP_COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")  # --cp-comm-type values (Megatron's names)


def cp_chunk_ids(cp_size: int, cp_rank: int):
    """The two global chunk indices held by ``cp_rank``, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_local_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global sequence positions of this rank's local tokens ([2 * seq_len / (2 CP)] long)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context parallel size ({cp_size})")
    c = seq_len // (2 * cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def cp_gather_order(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions of the rank-ordered concatenation of every rank's local tokens (what an all-gather over
    the CP group yields); ``argsort`` of it puts a gathered sequence back in natural order."""
    return torch.cat([cp_local_indices(seq_len, cp_size, r, device) for r in range(cp_size)])


def get_batch_on_this_cp_rank(batch: Dict[str, torch.Tensor], cp_size: Optional[int] = None,
                              cp_rank: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Keep this CP rank's two chunks of every [b, s] tensor (sequence dim 1; dim 2 of a [b, 1, s, s]
    attention mask). Document boundaries (``cu_seqlens*``, ``max_seqlen``) stay global: attention needs them
    to mask keys that live on other ranks."""
    if cp_size is None:
        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
    if cp_size == 1:
        return batch
    out = {}
    for key, val in batch.items():
        if val is None or key.startswith("cu_seqlens") or key.startswith("max_seqlen"):
            out[key] = val
            continue
        dim = 2 if key == "attention_mask" else 1
        idx = cp_local_indices(val.size(dim), cp_size, cp_rank, val.device)
        out[key] = val.index_select(dim, idx)
    return out


class DocumentLayout:
    """Per-token document ids and in-document positions of a packed [b, S] batch (S: full sequence).

    ``cu_seqlens`` runs over the b * S tokens flattened sample by sample (THD order); a sample boundary is
    always a document boundary. Zero-length documents (repeated offsets, used as padding) are harmless.
    """

    def __init__(self, cu_seqlens: torch.Tensor, batch: int, seq_len: int):
        total = batch * seq_len
        cu = cu_seqlens.to(torch.long).flatten()
        if int(cu[-1]) != total:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the batch has {batch} x {seq_len} = "
                             f"{total} tokens")
        token = torch.arange(total, device=cu.device)
        doc = torch.searchsorted(cu, token, right=True) - 1  # document of each flattened token
        # Sample boundaries split documents too: offset ids by sample so they never compare equal.
        sample = token // seq_len
        doc = doc * batch + sample
        self.doc = doc.view(batch, seq_len)  # [b, S]
        self.pos_in_doc = (token - torch.maximum(cu[doc // batch], sample * seq_len)).view(batch, seq_len)
        self.seq_len = seq_len

    def local(self, cp_size: int, cp_rank: int):
        """(doc ids [b, s_local], global positions [s_local]) of a CP rank's tokens."""
        idx = cp_local_indices(self.seq_len, cp_size, cp_rank, self.doc.device)
        return self.doc.index_select(1, idx), idx


def document_layout(packed_seq_params, batch: int, seq_len: int) -> DocumentLayout:
    """The DocumentLayout of a PackedSeqParams, built once and cached on it (every layer shares it)."""
    cache = packed_seq_params.__dict__.setdefault("_layout_cache", {})
    key = (batch, seq_len)
    if key not in cache:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        cache[key] = DocumentLayout(cu, batch, seq_len)
    return cache[key]


def local_rotary_pos_emb(freqs: torch.Tensor, cp_size: int, packed_seq_params=None, batch: int = 1,
                         cp_rank: Optional[int] = None):
    """RoPE angles of this rank's tokens from the table of positions 0..S-1 ([S, 1, 1, d]).

    Packed documents restart at position 0 (Megatron's THD RoPE): rows become [S, b, 1, d]. Under CP the
    rows of this rank's two chunks are kept (``cp_rank``: in an explicit CP group; parallel_state's when None)."""
    seq_len = freqs.size(0)
    if packed_seq_params is not None:
        pos = document_layout(packed_seq_params, batch, seq_len).pos_in_doc  # [b, S]
        freqs = freqs[:, 0, 0][pos.t()][:, :, None, :]  # [S, b, 1, d]
    if cp_size > 1:
        cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
        idx = cp_local_indices(seq_len, cp_size, cp_rank, freqs.device)
        freqs = freqs.index_select(0, idx)
    return freqs
