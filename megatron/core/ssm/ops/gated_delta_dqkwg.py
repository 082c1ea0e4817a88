"""The dq / dk / dw / dg step of the chunked gated delta rule's backward in PyTorch, batched over all chunks:
the step that flash-linear-attention (fla 0.6.0) runs as ``chunk_bwd_dqkwg`` and that Triton 3.4.0 - 3.7.0
compiles wrongly on Hopper (fla issue #640). Same inputs, outputs and layouts as fla's, so the rest of fla's
backward runs around it unchanged.

Per chunk of BT tokens (rows i, j), per value head, with h the state entering the chunk [K, V], dh the gradient of
the state leaving it, v the chunk's new values (fla's ``v_new``), dv their gradient and g the chunk-local cumulative
log decay in log2 units (fla keeps g / ln 2 and uses exp2), the step is the backward of
    o = scale (exp2(g) q h + (q k^T * exp2(g_i - g_j))_{i >= j} v),
    h_next = exp2(g_last) h + (exp2(g_last - g) k)^T v,     v_new = u - w h.
dg is the gradient with respect to the cumulative decay (natural-log units, as fla's), before the reverse cumsum.
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F


@contextmanager
def _tf32_matmuls(on_cuda: bool):
    """fp32 matmuls on TF32 tensor cores on CUDA (fp32 accumulation; 10-bit input mantissas hold the bf16 inputs
    exactly and round only the fp32 intermediates, which fla's kernel rounds to bf16 before its dots), instead of
    the fp32 SIMT path, several times slower. CPU keeps full fp32 (and fp64 in the tests)."""
    if not on_cuda:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or wider if it is (fp64 in tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunked(x: torch.Tensor, nt: int, bt: int, groups: int = 1) -> torch.Tensor:
    """[B, T, heads, D] -> [B, NT, heads / groups, groups, BT, D] in fp32, zero-padded to NT * BT tokens."""
    b, t, heads, d = x.shape
    x = F.pad(_acc(x), (0, 0, 0, 0, 0, nt * bt - t))
    return x.view(b, nt, bt, heads // groups, groups, d).permute(0, 1, 3, 4, 2, 5)


def _unchunked(x: torch.Tensor, t: int) -> torch.Tensor:
    """[B, NT, heads, BT, D] -> [B, T, heads, D] (the padding dropped), contiguous as fla's kernels need."""
    b, nt, heads, bt, d = x.shape
    return x.permute(0, 1, 3, 2, 4).reshape(b, nt * bt, heads, d)[:, :t].contiguous()


def chunk_bwd_dqkwg_torch(q, k, v, w, g, h, dv, do, dh, scale: float, chunk_size: int = 64,
                          state_v_first: bool = False):
    """(dq, dk, dw, dg) of the gated delta rule's chunk step, as fla 0.6.0's ``chunk_bwd_dqkwg`` returns them.

    q, k [B, T, H, K]; v (fla's v_new), do, dv [B, T, HV, V]; w [B, T, HV, K]; g [B, T, HV] (chunk-local cumsum, log2
    units); h, dh [B, NT, HV, K, V] ([.., V, K] if ``state_v_first``). Value head i reads key head i // (HV / H).
    Returns dq, dk [B, T, H, K] (summed over each key head's value heads), dw [B, T, HV, K], dg [B, T, HV] fp32.
    Arithmetic in fp32 (fp64 for fp64 inputs), matmuls on TF32 tensor cores on CUDA; no loop over chunks."""
    with _tf32_matmuls(q.is_cuda):
        return _chunk_bwd_dqkwg(q, k, v, w, g, h, dv, do, dh, scale, chunk_size, state_v_first)


def _chunk_bwd_dqkwg(q, k, v, w, g, h, dv, do, dh, scale: float, chunk_size: int, state_v_first: bool):
    B, T, H, K = q.shape
    HV = v.shape[2]
    G, bt = HV // H, chunk_size
    nt = -(-T // bt)
    assert h.shape[:3] == (B, nt, HV) and HV % H == 0, (h.shape, q.shape, v.shape)
    # [B, NT, H, G, BT, D]: value heads grouped under their key head; q and k broadcast over the group
    qc, kc = _chunked(q, nt, bt), _chunked(k, nt, bt)
    vc, doc, dvc = (_chunked(t, nt, bt, G) for t in (v, do, dv))
    # padded tokens repeat the last cumulative decay, so g_last is each chunk's last real token's value
    gp = torch.cat([_acc(g), _acc(g[:, -1:]).expand(B, nt * bt - T, HV)], dim=1)
    gc = gp.view(B, nt, bt, H, G).permute(0, 1, 3, 4, 2)  # [B, NT, H, G, BT]
    g_last = gc[..., -1:]  # [B, NT, H, G, 1]
    hc, dhc = (_acc(t).view(B, nt, H, G, *t.shape[-2:]) for t in (h, dh))
    if state_v_first:
        hc, dhc = hc.transpose(-1, -2), dhc.transpose(-1, -2)  # -> [.., K, V]

    # inter-chunk terms: through the state entering (h) and leaving (dh) the chunk
    dq = (doc @ hc.transpose(-1, -2)) * (gc.exp2() * scale)[..., None]
    dk = (vc @ dhc.transpose(-1, -2)) * (g_last - gc).exp2()[..., None]
    dw = -(dvc @ hc.transpose(-1, -2))
    dg_last = (hc * dhc).sum((-2, -1)) * g_last[..., 0].exp2() + (dk * kc).sum((-2, -1))  # [B, NT, H, G]
    # intra-chunk terms: ds[i, j] = do_i . v_j exp2(g_i - g_j) for j <= i
    causal = torch.ones(bt, bt, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp2()
    ds = (doc @ vc.transpose(-1, -2)) * decay * scale  # [B, NT, H, G, BT, BT]
    dq = dq + ds @ kc
    dk = dk + ds.transpose(-1, -2) @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [B, NT, H, G, BT]
    # g_last belongs to the chunk's last real token
    starts = torch.arange(nt, device=q.device) * bt
    last = (starts + bt).clamp(max=T) - 1 - starts  # [NT]
    at_last = F.one_hot(last, bt).to(dg.dtype)[:, None, None, :]  # [NT, 1, 1, BT]
    dg = dg + dg_last[..., None] * at_last

    dq = _unchunked(dq.sum(3), T).to(q.dtype)
    dk = _unchunked(dk.sum(3), T).to(k.dtype)
    dw = _unchunked(dw.flatten(2, 3), T).to(w.dtype)
    dg = _unchunked(dg.flatten(2, 3)[..., None], T)[..., 0]
    return dq, dk, dw, dg
