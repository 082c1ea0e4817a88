"""One-token recurrences of the SSM mixers, for generation: the short causal conv, the Mamba-2 SSD state and
the gated delta rule, each updating its state in place (the state buffers are views into the inference
context's per-slot storage, so a decode step writes them where they live, also inside a CUDA graph).

Shapes are batch-first: conv states [b, c, w - 1] (the last w - 1 conv inputs), SSD states [b, h, p, n], delta
rule states [b, h, dk, dv]; the mixers keep SSM states in fp32, as the chunked scans compute.
"""
from typing import Optional

import torch


def conv_state_after(xbc: torch.Tensor, lengths: Optional[torch.Tensor], width: int) -> torch.Tensor:
    """The conv state after a prompt: the last ``width - 1`` conv inputs of each row, ending at its length
    (rows are right-padded to a common length; None: every row is full). xbc [b, s, c] -> [b, c, width - 1],
    zeros where a prompt is shorter than the window."""
    b, s, c = xbc.shape
    padded = torch.nn.functional.pad(xbc, (0, 0, width - 1, 0))  # [b, w - 1 + s, c]
    ends = torch.full((b,), s, device=xbc.device) if lengths is None else lengths
    # In padded coordinates the window ending at position len - 1 is [len, len + w - 1).
    index = ends[:, None] + torch.arange(width - 1, device=xbc.device)[None, :]  # [b, w - 1]
    window = padded.gather(1, index[..., None].expand(b, width - 1, c))
    return window.transpose(1, 2)


def causal_conv1d_step(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Depthwise causal conv for one new input x [b, c] (weight [c, 1, w]); shifts ``conv_state`` in place.
    Returns the conv output [b, c] (before the activation)."""
    window = torch.cat([conv_state, x[..., None].to(conv_state.dtype)], dim=-1)  # [b, c, w]
    conv_state.copy_(window[..., 1:])
    out = (window * weight[:, 0, :].to(window.dtype)).sum(-1)
    return out if bias is None else out + bias.to(out.dtype)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mamba-2 for one token: S = exp(dt A) S + dt x B^T, y = S C + D x. x [b, h, p], dt [b, h] (softplus'ed,
    biased), A [h], B / C [b, g, n]; ``state`` [b, h, p, n] updated in place. Returns y [b, h, p] in fp32."""
    h = x.shape[1]
    Bh = B.float().repeat_interleave(h // B.shape[1], dim=1)  # [b, h, n]
    Ch = C.float().repeat_interleave(h // C.shape[1], dim=1)
    dt, xf = dt.float(), x.float()
    state.mul_(torch.exp(dt * A.float())[..., None, None])
    state.add_((dt[..., None] * xf)[..., None] * Bh[:, :, None, :])
    y = torch.einsum("bhpn,bhn->bhp", state, Ch)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.numel() == h else D.float().reshape(h, -1))
    return y


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """The gated delta rule for one token: S = exp(g) S + beta k (v - exp(g) S^T k)^T, o = S^T (scale q).
    q, k [b, h, dk], v [b, h, dv], g, beta [b, h]; ``state`` [b, h, dk, dv] updated in place. Returns o
    [b, h, dv] in fp32."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = q.float(), k.float(), v.float()
    state.mul_(g.float().exp()[..., None, None])
    delta = (vf - torch.einsum("bhkv,bhk->bhv", state, kf)) * beta.float()[..., None]
    state.add_(kf[..., None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, qf * scale)
