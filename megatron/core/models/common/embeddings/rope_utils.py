"""Apply rotary position embeddings to ``[s, b, n, d]`` tensors."""
import torch

from megatron.core.fusions.compile import maybe_compile


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)  # re-interleave pairs


def _rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float, rotary_interleaved: bool) -> torch.Tensor:
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.numel() else t_rot


# --apply-rope-fusion (Megatron's default; --no-rope-fusion turns it off): the same math as one compiled
# kernel per direction on CUDA (cos/sin, the rotation and the pass-through channels fused), eager elsewhere.
_rope_fused = maybe_compile(_rope)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None, cu_seqlens=None,
                         mscale: float = 1.0, rotary_interleaved: bool = None) -> torch.Tensor:
    """t * cos + rotate_half(t) * sin on the first ``freqs.shape[-1]`` channels; the rest pass through.
    ``freqs``: [s, 1, 1, rot_dim]. Fused on CUDA when ``config.apply_rope_fusion``."""
    if cu_seqlens is not None:
        raise NotImplementedError("RoPE on packed sequences is not supported")
    if rotary_interleaved is None:
        rotary_interleaved = bool(config.rotary_interleaved) if config is not None else False
    freqs = freqs[: t.shape[0]].to(t.device)
    fused = config is not None and getattr(config, "apply_rope_fusion", False)
    return (_rope_fused if fused else _rope)(t, freqs, float(mscale), rotary_interleaved)
