"""Apply rotary position embeddings to ``[s, b, n, d]`` tensors."""
import weakref

import torch

from megatron.core.fusions import rope as fused_rope
from megatron.core.fusions.compile import maybe_compile


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)  # re-interleave pairs


class _RopeHalves(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin, written half by half (non-interleaved layout).

    The textbook form reads and writes t five times per direction (the negated half, the rotated copy, two
    products, their sum); here each output half is one product and one fused multiply-add
    (``addcmul``), and the backward is the same four half-size passes: about half the memory traffic,
    with plain PyTorch ops (the eager path of ``--no-rope-fusion``). Exact for any cos/sin, including
    ones whose halves differ."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        x1, x2 = t.chunk(2, dim=-1)
        c1, c2 = cos.chunk(2, dim=-1)
        s1, s2 = sin.chunk(2, dim=-1)
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        g1, g2 = grad.chunk(2, dim=-1)
        c1, c2 = cos.chunk(2, dim=-1)
        s1, s2 = sin.chunk(2, dim=-1)
        dt = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        d1, d2 = dt.chunk(2, dim=-1)
        torch.mul(g1, c1, out=d1).addcmul_(g2, s2)
        torch.mul(g2, c2, out=d2).addcmul_(g1, s1, value=-1)
        return dt, None, None


_COS_SIN = {}  # "last": (weakref to the caller's freqs, its _version, key, cos, sin)


def _angles(freqs: torch.Tensor, t: torch.Tensor, mscale: float):
    """(cos, sin) of ``freqs`` times ``mscale``, in ``t``'s dtype."""
    return (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)


def _cos_sin(freqs_arg: torch.Tensor, t: torch.Tensor, mscale: float):
    """(cos, sin) of ``freqs_arg[:s]`` times ``mscale`` in ``t``'s dtype and device, s = t.shape[0].

    The model computes one freqs tensor per forward and every layer rotates q and k with it: the same six small
    kernels (cos, sin, scale, cast) ran twice per layer, 12 launches a layer that a host-bound step pays
    in full. The last result is kept for the same freqs object (held weakly, so a new or freed tensor never
    matches; an in-place change bumps its version) and the same length, dtype, device and scale. Computed
    afresh where it would not be safe to keep: during CUDA-graph capture (a kept tensor from outside the
    graph, freed later, would still be read by its replays), when freqs needs a gradient, or for an inference
    tensor (made under ``torch.inference_mode``: no version counter tells of an in-place change)."""
    key = (t.shape[0], t.dtype, t.device, mscale)
    keep = (not freqs_arg.requires_grad and not freqs_arg.is_inference()
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing()))
    last = _COS_SIN.get("last")
    if keep and last is not None and last[0]() is freqs_arg and last[1] == freqs_arg._version and last[2] == key:
        return last[3], last[4]
    cos, sin = _angles(freqs_arg[: t.shape[0]].to(t.device), t, mscale)
    if keep:
        _COS_SIN["last"] = (weakref.ref(freqs_arg), freqs_arg._version, key, cos, sin)
    return cos, sin


def _rope_eager(t: torch.Tensor, freqs: torch.Tensor, mscale: float, rotary_interleaved: bool,
                freqs_arg: torch.Tensor = None) -> torch.Tensor:
    """The unfused path: the half-by-half rotation where it applies, else the textbook form (also when
    traced by torch.compile, which fuses the textbook form itself). ``freqs_arg``: the caller's freqs
    before slicing, whose cos and sin are kept for the next call (``_cos_sin``)."""
    rot_dim = freqs.shape[-1]
    if rotary_interleaved or rot_dim % 2 or torch.compiler.is_compiling():
        return _rope(t, freqs, mscale, rotary_interleaved)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = _cos_sin(freqs_arg, t, mscale) if freqs_arg is not None else _angles(freqs, t, mscale)
    t_rot = _RopeHalves.apply(t_rot, cos, sin)
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.numel() else t_rot


def _rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float, rotary_interleaved: bool) -> torch.Tensor:
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = _angles(freqs, t, mscale)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.numel() else t_rot


_rope_compiled = maybe_compile(_rope)


def _rope_fused(t: torch.Tensor, freqs: torch.Tensor, mscale: float, rotary_interleaved: bool) -> torch.Tensor:
    """--apply-rope-fusion (Megatron's default; --no-rope-fusion turns it off): the same math as one Triton
    kernel per direction on CUDA (`megatron.core.fusions.rope`: cos/sin, the rotation and the pass-through channels
    in one pass over t's strided view); compiled where the kernel does not cover the call, eager on CPU."""
    if fused_rope.available(t, freqs):
        return fused_rope.rope(t, freqs, mscale, rotary_interleaved)
    return _rope_compiled(t, freqs, mscale, rotary_interleaved)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None, cu_seqlens=None,
                         mscale: float = 1.0, rotary_interleaved: bool = None) -> torch.Tensor:
    """t * cos + rotate_half(t) * sin on the first ``freqs.shape[-1]`` channels; the rest pass through.
    ``freqs``: [s, 1, 1, rot_dim]. Fused on CUDA when ``config.apply_rope_fusion``."""
    if cu_seqlens is not None:
        raise NotImplementedError("RoPE on packed sequences is not supported")
    if rotary_interleaved is None:
        rotary_interleaved = bool(config.rotary_interleaved) if config is not None else False
    freqs_arg, freqs = freqs, freqs[: t.shape[0]].to(t.device)
    if config is not None and getattr(config, "apply_rope_fusion", False):
        return _rope_fused(t, freqs, float(mscale), rotary_interleaved)
    return _rope_eager(t, freqs, float(mscale), rotary_interleaved, freqs_arg)
