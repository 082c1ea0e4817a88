"""--apply-rope-fusion (Megatron's default): rotary position embeddings as one Triton kernel per direction.

The rotation of ``rope_utils._rope`` (t * cos + rotate_half(t) * sin on the first rot_dim channels, the rest passed
through; half-by-half or interleaved pairs; YaRN's mscale) in one pass that reads t's strided view where it lies
(the query and key are views of the fused QKV projection) and computes cos and sin in fp32 from the positions'
freqs, instead of a torch.compile'd graph: no compilation at the first step (a graph per shape and direction),
no compiled wrapper's host cost at each of the two calls per layer. The values equal the eager rotation's to
rounding (cos and sin stay fp32 here, where the eager form casts them to the activations' dtype).
"""
import torch

from megatron.core.fusions.triton_loader import triton_loader


def _load():
    from megatron.core.fusions import _triton_rope as k  # lazy: optional dependency (Triton)
    return k


_kernels = triton_loader(_load)


def available(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """The kernel covers this call: CUDA [s, b, n, d] activations whose channels are contiguous, freqs [>= s, ...,
    rot] with an even rot <= d that needs no gradient, a Triton that builds kernels, outside torch.compile."""
    rot = freqs.shape[-1]
    return (t.is_cuda and t.dim() == 4 and t.stride(-1) == 1 and freqs.stride(-1) == 1 and freqs.is_cuda
            and rot % 2 == 0 and 0 < rot <= t.shape[-1] and freqs.shape[0] >= t.shape[0]
            and not freqs.requires_grad and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not torch.compiler.is_compiling() and bool(_kernels()))


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, mscale, interleaved):
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        _kernels().rope(t, freqs, out, mscale, interleaved, backward=False)
        ctx.save_for_backward(freqs)
        ctx.args = (mscale, interleaved)
        return out

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        dt = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        _kernels().rope(grad, freqs, dt, *ctx.args, backward=True)
        return dt, None, None, None


def rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0, interleaved: bool = False) -> torch.Tensor:
    """The rotated ``t`` [s, b, n, d] (contiguous, t's dtype) for ``freqs`` [>= s, 1, 1, rot] (fp32)."""
    return _Rope.apply(t, freqs, float(mscale), bool(interleaved))
