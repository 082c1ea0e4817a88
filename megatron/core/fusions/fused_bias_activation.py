"""Bias + activation (GeLU, SwiGLU) as one compiled element-wise kernel on CUDA; plain torch elsewhere.

Megatron's ``--bias-gelu-fusion`` / ``--bias-swiglu-fusion`` (both on by default) fuse these with its
``jit_fuser`` (torch.compile); eager torch runs the bias add, the activation and the gating product as
separate kernels, each a full read and write of the ``[s, b, ffn]`` activation and its gradient.
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.compile import maybe_compile
from megatron.core.fusions.swiglu import swiglu, triton_swiglu_available


def _with_bias(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x if bias is None else x + bias


@maybe_compile
def _bias_swiglu_compiled(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    gate, up = torch.chunk(_with_bias(x, bias), 2, dim=-1)  # [s, b, f] each
    return F.silu(gate) * up


def bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Without a bias on CUDA: the Triton kernels of `fusions.swiglu` (faster than the compiled form);
    otherwise bias + SwiGLU compiled into one kernel."""
    if bias is None and triton_swiglu_available(x):
        return swiglu(x)
    return _bias_swiglu_compiled(x, bias)


bias_swiglu.eager = getattr(_bias_swiglu_compiled, "eager", _bias_swiglu_compiled)


@maybe_compile
def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.gelu(_with_bias(x, bias))


@maybe_compile
def bias_gelu_tanh(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.gelu(_with_bias(x, bias), approximate="tanh")


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (``--openai-gelu``, GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


def fused_bias_activation(activation_func: Callable, gated: bool) -> Optional[Callable]:
    """The fused ``f(x, bias)`` for a config's activation, or None where none applies (e.g. squared ReLU)."""
    if gated:
        return bias_swiglu if activation_func is F.silu else None
    if activation_func is F.gelu:
        return bias_gelu
    return bias_gelu_tanh if activation_func is openai_gelu else None
