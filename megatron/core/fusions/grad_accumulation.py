"""``main_grad += grad``: a 16-bit gradient added into the fp32 DDP buffer at full memory bandwidth.

torch's in-place add of a bf16 tensor into an fp32 one runs its generic (unrolled, non-vectorized)
element-wise kernel: on H200 it measured about half the HBM bandwidth, ~37 ms per iteration of the
Mixtral-shaped MoE benchmark, whose grouped expert weights get their gradient outside the fused wgrad
GEMM. A flat Triton kernel with vector loads of both operands does the same fp32 additions (bitwise the
same result). Elsewhere (CPU, no Triton, strided or small tensors) ``Tensor.add_``.

The first gradient a parameter gets in an iteration lands on the zeros the buffer was reset to, so DDP's hook
asks for ``overwrite`` there: 0 + g is g exactly, and the fp32 buffer is not read (6 instead of 10 bytes per
element; the fine-grained MoE benchmark's 4.4 B expert weights take their gradient this way every micro-batch)."""
import torch

from megatron.core.fusions.triton_loader import triton_loader

_MIN_NUMEL = 1 << 16  # below this a launch costs more than the bandwidth saves


def _load():
    from megatron.core.fusions._triton_grad_accumulation import accumulate  # lazy: optional dependency (Triton)
    return accumulate


_triton_impl = triton_loader(_load)


def accumulate_into_main_grad(main_grad: torch.Tensor, grad: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """``main_grad += grad``; with ``overwrite`` (the caller knows main_grad holds zeros) ``main_grad = grad``,
    which skips reading the fp32 buffer: a third of the traffic of the add."""
    if (main_grad.is_cuda and main_grad.dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16)
            and main_grad.numel() >= _MIN_NUMEL and main_grad.shape == grad.shape
            and main_grad.is_contiguous() and grad.is_contiguous() and not torch.compiler.is_compiling()):
        impl = _triton_impl()
        if impl:
            impl(main_grad, grad, add=not overwrite)
            return main_grad
    return main_grad.copy_(grad) if overwrite else main_grad.add_(grad)


def claim_first_write(param: torch.Tensor) -> bool:
    """True when this write of ``param``'s gradient is the first of the iteration onto the zeros DDP's
    ``zero_grad_buffer`` left in ``param.main_grad`` (it sets ``main_grad_fresh``), so the writer may store
    instead of add; claims it either way, and every fused writer's placeholder (``grad_added_to_main_grad``) bars
    it for the rest of the iteration. The choice is made on the host per call, so never while a CUDA graph is
    captured or a region traced (their replays would repeat it, write where they must add)."""
    fresh = (getattr(param, "main_grad_fresh", False) and not getattr(param, "grad_added_to_main_grad", False)
             and not torch.compiler.is_compiling()
             and not (param.main_grad.is_cuda and torch.cuda.is_current_stream_capturing()))
    param.main_grad_fresh = False
    return fresh
