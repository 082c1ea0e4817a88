"""The batched PyTorch dq/dk/dw/dg step of the gated delta rule's backward (what replaces fla's ``chunk_bwd_dqkwg`` on
Hopper with Triton 3.4-3.7) equals autograd through the chunk step it is the backward of, written chunk by chunk in
fp64: grouped value heads, a partial last chunk, both state layouts. fp64 both sides: agreement to 1e-10 relative."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.ops.gated_delta_dqkwg import chunk_bwd_dqkwg_torch


def _chunk_step_loss(q, k, v, w, G, h, do, dh, dv, scale, bt):
    """sum(do . o) + sum(dh . h_next) + sum(dv . (-w h)) over chunks, with G the natural-log chunk-local cumulative
    decay [B, T, HV], h the state entering each chunk [B, NT, HV, K, V] and dh the gradient of the one leaving it."""
    B, T, HV, _ = v.shape
    group = HV // q.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    total = 0
    for c, start in enumerate(range(0, T, bt)):
        s = slice(start, min(start + bt, T))
        qc, kc, vc, wc, Gc = (t[:, s].transpose(1, 2) for t in (q, k, v, w, G))  # [B, HV, L, ...]
        doc, dvc = do[:, s].transpose(1, 2), dv[:, s].transpose(1, 2)
        hc, dhc = h[:, c], dh[:, c]
        G_last = Gc[..., -1:]
        decay = (Gc[..., :, None] - Gc[..., None, :]).exp().tril()
        o = scale * ((Gc.exp()[..., None] * qc) @ hc + ((qc @ kc.transpose(-1, -2)) * decay) @ vc)
        h_next = G_last.exp()[..., None] * hc + ((G_last - Gc).exp()[..., None] * kc).transpose(-1, -2) @ vc
        total = total + (doc * o).sum() + (dhc * h_next).sum() - (dvc * (wc @ hc)).sum()
    return total


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("B,T,H,HV,K,V,bt", [(2, 40, 2, 2, 8, 12, 16), (1, 37, 1, 3, 8, 8, 16),
                                             (2, 64, 2, 4, 4, 8, 32)])
def test_torch_dqkwg_matches_autograd_of_the_chunk_step(B, T, H, HV, K, V, bt, state_v_first):
    gen = torch.Generator().manual_seed(T + HV)
    nt = -(-T // bt)
    f64 = dict(dtype=torch.float64, generator=gen)
    q, k = torch.randn(B, T, H, K, **f64), torch.randn(B, T, H, K, **f64)
    v, do, dv, w = (torch.randn(B, T, HV, d, **f64) for d in (V, V, V, K))
    h, dh = torch.randn(B, nt, HV, K, V, **f64), torch.randn(B, nt, HV, K, V, **f64)
    # the chunk-local cumulative log decay, as fla's forward leaves it
    g_step = F.logsigmoid(torch.randn(B, T, HV, **f64) + 2)
    G = torch.cat([c.cumsum(1) for c in g_step.split(bt, dim=1)], dim=1)
    scale = 0.3

    leaves = [t.clone().requires_grad_() for t in (q, k, w, G)]
    _chunk_step_loss(leaves[0], leaves[1], v, leaves[2], leaves[3], h, do, dh, dv, scale, bt).backward()
    state = (lambda t: t.transpose(-1, -2).contiguous()) if state_v_first else (lambda t: t)
    got = chunk_bwd_dqkwg_torch(q, k, v, w, G / math.log(2), state(h), dv, do, state(dh), scale, chunk_size=bt,
                                state_v_first=state_v_first)
    for name, a, leaf in zip("dq dk dw dg".split(), got, leaves):
        ref = leaf.grad
        assert a.shape == ref.shape, name
        assert (a - ref).abs().max() <= 1e-10 * ref.abs().max(), name
