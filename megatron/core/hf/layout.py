"""Tensor layouts that differ between Hugging Face and our global (TP=1) state dict.

Fused QKV (ours, see `SelfAttention`): rows grouped per query group g = 0..ng-1 as
    [q heads of group g (np/ng * hn rows); k of group g (hn rows); v of group g (hn rows)]
HF keeps q_proj [np*hn, h], k_proj [ng*hn, h], v_proj [ng*hn, h] apart (GPT-2: one Conv1D c_attn [h, 3h]).

Gated MLP (ours, `MLP` with gated_linear_unit): linear_fc1 = [gate; up] = cat(gate_proj, up_proj), [2f, h].
Biases follow their weights (1-D tensors use the same row order).
"""
from dataclasses import dataclass
from typing import Callable, List

import torch


@dataclass(frozen=True)
class Dims:
    """The shapes a layout needs: heads, query groups, head dim, padded and true vocab."""
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


@dataclass(frozen=True)
class Transform:
    """``to_ours(hf_tensors, dims) -> tensor`` and its inverse ``to_hf(tensor, dims) -> hf_tensors``."""
    to_ours: Callable
    to_hf: Callable


def _fuse_qkv(tensors: List[torch.Tensor], d: Dims) -> torch.Tensor:
    q, k, v = tensors
    rest = q.shape[1:]
    per_group = d.num_heads // d.num_groups
    q = q.reshape(d.num_groups, per_group * d.head_dim, *rest)  # [ng, np/ng*hn, (h)]
    k = k.reshape(d.num_groups, d.head_dim, *rest)  # [ng, hn, (h)]
    v = v.reshape(d.num_groups, d.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [ng*(np/ng+2)*hn, (h)]


def _split_qkv(t: torch.Tensor, d: Dims) -> List[torch.Tensor]:
    rest = t.shape[1:]
    per_group = d.num_heads // d.num_groups
    t = t.reshape(d.num_groups, (per_group + 2) * d.head_dim, *rest)
    q, k, v = torch.split(t, [per_group * d.head_dim, d.head_dim, d.head_dim], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _pad_vocab(tensors: List[torch.Tensor], d: Dims) -> torch.Tensor:
    """Extra rows up to the padded vocab are zeros (ids the tokenizer never produces)."""
    (t,) = tensors
    if t.shape[0] != d.vocab_size:
        raise ValueError(f"vocab dimension {t.shape[0]} does not match config.json vocab_size {d.vocab_size}")
    if d.padded_vocab_size == d.vocab_size:
        return t
    pad = t.new_zeros((d.padded_vocab_size - d.vocab_size,) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _strip_vocab(t: torch.Tensor, d: Dims) -> List[torch.Tensor]:
    """Rows beyond the true vocab go; rows a model never had (trained with a tokenizer smaller than
    config.json's vocab_size, e.g. Qwen2.5) come back as zeros so the shapes match config.json."""
    if t.shape[0] < d.vocab_size:
        return [torch.cat([t, t.new_zeros((d.vocab_size - t.shape[0],) + tuple(t.shape[1:]))])]
    return [t[:d.vocab_size].contiguous()]


def _conv1d_qkv(tensors, d):
    (w,) = tensors  # GPT-2 Conv1D: [h, 3h] (in, out) or bias [3h]
    t = w.t() if w.dim() == 2 else w
    return _fuse_qkv(list(torch.chunk(t, 3, dim=0)), d)


def _conv1d_qkv_back(t, d):
    w = torch.cat(_split_qkv(t, d), dim=0)
    return [w.t().contiguous() if w.dim() == 2 else w]


COPY = Transform(lambda ts, d: ts[0], lambda t, d: [t])
QKV = Transform(_fuse_qkv, _split_qkv)
GATE_UP = Transform(lambda ts, d: torch.cat(ts, dim=0), lambda t, d: [x.contiguous() for x in torch.chunk(t, 2, dim=0)])
VOCAB = Transform(_pad_vocab, _strip_vocab)
# GPT-2's Conv1D stores weights as [in, out]; ours are [out, in] like nn.Linear.
CONV1D = Transform(lambda ts, d: ts[0].t().contiguous() if ts[0].dim() == 2 else ts[0],
                   lambda t, d: [t.t().contiguous() if t.dim() == 2 else t])
CONV1D_QKV = Transform(_conv1d_qkv, _conv1d_qkv_back)
