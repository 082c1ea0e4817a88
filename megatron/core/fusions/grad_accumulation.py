"""``main_grad += grad``: a 16-bit gradient added into the fp32 DDP buffer at full memory bandwidth.

torch's in-place add of a bf16 tensor into an fp32 one runs its generic (unrolled, non-vectorized)
element-wise kernel: on H200 it measured about half the HBM bandwidth, ~37 ms per iteration of the
Mixtral-shaped MoE benchmark, whose grouped expert weights get their gradient outside the fused wgrad
GEMM. A flat Triton kernel with vector loads of both operands does the same fp32 additions (bitwise the
same result). Elsewhere (CPU, no Triton, strided or small tensors) ``Tensor.add_``."""
import torch

from megatron.core.fusions.triton_loader import triton_loader

_MIN_NUMEL = 1 << 16  # below this a launch costs more than the bandwidth saves


def _load():
    from megatron.core.fusions._triton_grad_accumulation import accumulate  # lazy: optional dependency (Triton)
    return accumulate


_triton_impl = triton_loader(_load)


def accumulate_into_main_grad(main_grad: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if (main_grad.is_cuda and main_grad.dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16)
            and main_grad.numel() >= _MIN_NUMEL and main_grad.shape == grad.shape
            and main_grad.is_contiguous() and grad.is_contiguous() and not torch.compiler.is_compiling()):
        impl = _triton_impl()
        if impl:
            impl(main_grad, grad)
            return main_grad
    return main_grad.add_(grad)
