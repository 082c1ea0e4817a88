"""Packed sequences (several documents in one row, ``PackedSeqParams``) through the recurrent mixers: the short
causal conv must not reach back into the previous document, and the scan must start every document from a zero
state. The conv masks its taps at document boundaries; the scan runs once per document (any kernel: the
Triton ones and the eager references alike), so a packed row equals its documents run one by one."""
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F

from megatron.core.context_parallel.utils import DocumentLayout


def document_ids(packed_seq_params, batch: int, seq_len: int) -> torch.Tensor:
    """[b, s] document id of every token (ids differ across documents and across rows)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    if cu is None:
        raise ValueError("packed sequences through Mamba / Gated DeltaNet layers need cu_seqlens_q")
    return DocumentLayout(cu, batch, seq_len).doc


def causal_conv1d_documents(x: torch.Tensor, weight: torch.Tensor, bias, doc: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x [b, s, c] with weight [c, 1, k] (tap k - 1 is the current token), each
    output reading only inputs of its own document (bias added; no activation)."""
    k = weight.size(-1)
    out = x * weight[:, 0, k - 1]
    for j in range(1, k):  # input j tokens back, where it is in the same document
        shifted = F.pad(x, (0, 0, j, 0))[:, :-j]
        same = F.pad(doc, (j, 0), value=-1)[:, :-j] == doc  # [b, s]
        out = out + shifted * weight[:, 0, k - 1 - j] * same.unsqueeze(-1).to(x.dtype)
    return out if bias is None else out + bias


def document_spans(doc: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """Per row, the (start, end) of each document's run of tokens (one host read per micro-batch)."""
    b, s = doc.shape
    change = torch.ones(b, s, dtype=torch.bool, device=doc.device)
    change[:, 1:] = doc[:, 1:] != doc[:, :-1]
    spans = []
    for row in change.cpu():
        starts = torch.nonzero(row).flatten().tolist() + [s]
        spans.append(list(zip(starts[:-1], starts[1:])))
    return spans


def per_document(fn: Callable, spans, *tensors: torch.Tensor) -> torch.Tensor:
    """fn on every document's slice of ``tensors`` ([b, s, ...], sequence dim 1), outputs concatenated back
    to [b, s, ...]; fn returns a tensor of the slice's length."""
    rows = []
    for r, row_spans in enumerate(spans):
        rows.append(torch.cat([fn(*(t[r:r + 1, a:e] for t in tensors)) for a, e in row_spans], dim=1))
    return torch.cat(rows, dim=0)
