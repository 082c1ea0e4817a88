"""Mamba-2's SSD scan in eager PyTorch: the chunked form (runs anywhere, autograd through it) and a naive
step-by-step recurrence (tests only).

Per head h with group g = h // (H / G), state S [p, n]:
    S_t = exp(dt_t * A_h) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D_h x_t
Shapes are batch-first, as the kernels take them: x [b, l, h, p], dt [b, l, h] (already softplus'ed and
biased), A [h] (negative), B, C [b, l, g, n], D [h] or None; states [b, h, p, n].
"""

import torch
import torch.nn.functional as F


def _to_heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[b, l, g, n] -> [b, l, h, n]: each group's B/C serves h / g consecutive heads."""
    return t.repeat_interleave(nheads // t.size(2), dim=2)


def _segsum_exp(a_cum: torch.Tensor) -> torch.Tensor:
    """exp(a_cum[t] - a_cum[s]) for s <= t, 0 above the diagonal: [..., L] -> [..., L, L]. The masked
    entries are set to -inf before exp (their differences are positive and could overflow)."""
    L = a_cum.size(-1)
    diff = a_cum[..., :, None] - a_cum[..., None, :]
    upper = torch.ones(L, L, dtype=torch.bool, device=a_cum.device).triu(1)
    return diff.masked_fill(upper, float("-inf")).exp()


def ssd_chunk_scan_torch(x, dt, A, B, C, chunk_size: int, D=None, initial_states=None,
                         return_final_states: bool = False):
    """SSD in chunks of ``chunk_size``: quadratic attention-like products inside a chunk, a linear
    recurrence over chunk states between them. Computes in fp32; returns y in x's dtype (and the final
    state [b, h, p, n] in fp32 when asked)."""
    dtype = x.dtype
    b, l, h, p = x.shape
    pad = (-l) % chunk_size
    x, dt, B, C = (t.float() for t in (x, dt, B, C))
    Bh, Ch = _to_heads(B, h), _to_heads(C, h)
    if pad:  # zero dt on the padding: no decay and no input, so the final state is unchanged
        x, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, Bh, Ch))
        dt = F.pad(dt, (0, 0, 0, pad))
    nc = (l + pad) // chunk_size
    x = x.view(b, nc, chunk_size, h, p)
    Bh = Bh.view(b, nc, chunk_size, h, -1)
    Ch = Ch.view(b, nc, chunk_size, h, -1)
    dt = dt.view(b, nc, chunk_size, h)
    a_cum = torch.cumsum((dt * A.float()).permute(0, 3, 1, 2), dim=-1)  # [b, h, c, L]
    xdt = x * dt[..., None]  # [b, c, L, h, p]
    # Inside each chunk: y_t = sum_{s<=t} (C_t . B_s) exp(a_t - a_s) dt_s x_s
    scores = torch.einsum("bclhn,bcshn->bhcls", Ch, Bh) * _segsum_exp(a_cum)
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)
    # Each chunk's contribution to the state at its end, then the recurrence over chunks.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, L]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bh, decay_to_end, xdt)
    state = (torch.zeros(b, h, p, Bh.size(-1), dtype=torch.float32, device=x.device)
             if initial_states is None else initial_states.float())
    entering = []
    chunk_decay = torch.exp(a_cum[..., -1])  # [b, h, c]
    for c in range(nc):
        entering.append(state)
        state = state * chunk_decay[:, :, c, None, None] + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]: the state before each chunk
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, entering, torch.exp(a_cum))
    y = y.reshape(b, nc * chunk_size, h, p)[:, :l]
    if D is not None:
        y = y + x.reshape(b, nc * chunk_size, h, p)[:, :l] * _d_per_channel(D, h, p)
    y = y.to(dtype)
    return (y, state) if return_final_states else y


def _d_per_channel(D: torch.Tensor, h: int, p: int) -> torch.Tensor:
    """D [h] (one skip weight per head) or [h * p] / [h, p] (per channel) -> broadcastable [h, p]."""
    D = D.float()
    return D[:, None] if D.numel() == h else D.reshape(h, p)


def ssd_sequential_reference(x, dt, A, B, C, D=None, initial_states=None):
    """The recurrence one token at a time, in the dtype it is given (tests pass fp64). Returns (y, state)."""
    b, l, h, p = x.shape
    Bh, Ch = _to_heads(B, h), _to_heads(C, h)
    state = (torch.zeros(b, h, p, Bh.size(-1), dtype=x.dtype, device=x.device)
             if initial_states is None else initial_states.to(x.dtype))
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)  # [b, h]
        state = state * decay[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * D.to(x.dtype)[:, None] if D.numel() == h else y + x * D.to(x.dtype).reshape(h, p)
    return y, state
