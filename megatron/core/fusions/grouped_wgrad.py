"""The grouped experts' weight gradients straight into DDP's fp32 ``main_grad``.

Each MoE layer's two grouped weight-gradient GEMMs (dW_e = dY_e^T X_e, one block of rows per expert) wrote a 16-bit
[E, out, in] gradient that DDP's hook then added into the fp32 buffer: per element 2 bytes written, 2 + 4 read and 4
written again, every micro-batch. On the one-GPU fine-grained MoE benchmark (4.4 B expert weights) that add alone
took 45.6 ms of a ~505 ms iteration (profiled), at HBM bandwidth. The Triton kernel here
(`_triton_grouped_wgrad.py`) adds each output tile into ``main_grad`` in the GEMM's epilogue (or writes it, for the
iteration's first gradient on the zeroed buffer): 8 bytes per element (4 for the first), and the tile's traffic
overlaps the next tiles' loads.

Which way runs: a hand-written Triton GEMM may be slower than cuBLAS's grouped GEMM on some shapes, so the first
call for a weight shape times both ways on the real operands with a zero gradient (adding zeros changes nothing),
the kernel in each of its tile configurations, and keeps the fastest for the process; each choice is logged once
(INFO, logger ``megatron.core.fusions.grouped_wgrad``).
``MEGATRON_GROUPED_WGRAD=fused`` or ``grouped_mm`` forces one (A/B measurements). Where the kernel cannot run (CPU,
no Triton, fp32 weights, a traced region) the grouped GEMM and the add run, as before; under CUDA-graph capture an
unchosen shape takes that way too (no timing while capturing).
"""
import logging
import os
from typing import Callable, Dict, Optional, Tuple

import torch

from megatron.core.fusions.grad_accumulation import accumulate_into_main_grad
from megatron.core.fusions.triton_loader import triton_loader

logger = logging.getLogger(__name__)
_WAYS = ("fused", "grouped_mm")
# (main_grad shape, dtype, device) -> (the faster way, the fused kernel's fastest tile configuration), measured once
_CHOICE: Dict[Tuple, Tuple[str, Optional[tuple]]] = {}


def _load():
    from megatron.core.fusions import _triton_grouped_wgrad as k  # lazy: optional dependency (Triton)
    return k.grouped_wgrad, k.CONFIGS


_kernel = triton_loader(_load)


def fused_available(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> bool:
    return (grad.is_cuda and grad.dtype in (torch.bfloat16, torch.float16) and x.dtype == grad.dtype
            and main_grad.dtype == torch.float32 and main_grad.dim() == 3 and main_grad.is_contiguous()
            and grad.is_contiguous() and x.is_contiguous() and not torch.compiler.is_compiling()
            and bool(_kernel()))


def _grouped_mm_way(main_grad, grad, x, offs, overwrite: bool):
    accumulate_into_main_grad(main_grad, torch._grouped_mm(grad.t(), x, offs=offs), overwrite=overwrite)


def _fused_way(main_grad, grad, x, offs, overwrite: bool, config=None):
    kernel, configs = _kernel()
    block_m, block_n, block_k, warps, stages = config or configs[0]
    kernel(main_grad, grad, x, offs, accumulate=not overwrite, block_m=block_m, block_n=block_n, block_k=block_k,
           num_warps=warps, num_stages=stages)


def _time_ms(fn: Callable[[], None], reps: int = 3) -> float:
    """The best of ``reps`` timed calls after one untimed (compilation, cuBLAS plan selection)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _choose(main_grad, grad, x, offs) -> Tuple[str, Optional[tuple]]:
    forced = os.environ.get("MEGATRON_GROUPED_WGRAD", "auto")
    key = (tuple(main_grad.shape), grad.dtype, grad.device)
    if forced == "grouped_mm":
        return forced, None
    if forced == "fused":
        return forced, _CHOICE.get(key, (None, None))[1]
    if forced != "auto":
        raise ValueError(f"MEGATRON_GROUPED_WGRAD={forced!r}: use auto (the default), fused or grouped_mm")
    if key in _CHOICE:
        return _CHOICE[key]
    # A capture cannot time; --deterministic-mode (torch.use_deterministic_algorithms) asks for one way on every run,
    # where a timing can pick either (their bf16 roundings differ).
    if torch.are_deterministic_algorithms_enabled() or torch.cuda.is_current_stream_capturing():
        return "grouped_mm", None
    zeros = torch.zeros_like(grad)  # both ways then add zeros: main_grad keeps its values
    timed = {}
    for config in _kernel()[1]:
        try:
            timed[config] = _time_ms(lambda: _fused_way(main_grad, zeros, x, offs, False, config))
        except Exception as e:  # noqa: BLE001 (a tile this GPU or Triton cannot build or launch: skip it)
            logger.warning("expert weight gradients %s: the fused kernel with tiles %s failed (%s: %s)",
                           "x".join(map(str, main_grad.shape)), config, type(e).__name__, e)
    mm_ms = _time_ms(lambda: _grouped_mm_way(main_grad, zeros, x, offs, overwrite=False))
    best = min(timed, key=timed.get) if timed else None
    fused_ms = timed[best] if timed else float("inf")
    _CHOICE[key] = ("fused", best) if fused_ms < mm_ms else ("grouped_mm", None)
    logger.info("expert weight gradients %s into main_grad %s: fused kernel %.3f ms (tiles %s), grouped GEMM + add "
                "%.3f ms (%d rows): %s", "x".join(map(str, main_grad.shape)), grad.dtype, fused_ms, best, mm_ms,
                grad.shape[0], _CHOICE[key][0])
    return _CHOICE[key]


def grouped_wgrad_into_main_grad(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
                                 overwrite: bool = False):
    """``main_grad[e] += grad[rows of e]^T @ x[rows of e]`` for every expert e (``offs``: int32 cumulative row
    ends), or ``=`` with ``overwrite`` (main_grad holds zeros); ``grad`` [R, out], ``x`` [R, in], ``main_grad``
    [E, out, in]."""
    way, config = _choose(main_grad, grad, x, offs) if fused_available(main_grad, grad, x) else ("grouped_mm", None)
    if way == "fused":
        _fused_way(main_grad, grad, x, offs, overwrite, config)
    else:
        _grouped_mm_way(main_grad, grad, x, offs, overwrite)
