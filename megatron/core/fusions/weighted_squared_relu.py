"""--use-fused-weighted-squared-relu: an MoE expert's squared-ReLU activation times the token's routing probability.

relu(x)^2 * prob is computed in fp32 and cast back to the activations' dtype, as Megatron's fused kernel does (the
unfused path squares in the activations' dtype and multiplies by the probability cast to it: other rounding, the
same math). On CUDA it runs as one compiled element-wise kernel per direction (torch.compile with a dynamic token
count, which changes every micro-batch): eager it is four passes forward over the [tokens x top-k, ffn] expert
activations, and the backward keeps fp32 intermediates. If compilation fails here it says so once and runs eager.
"""
import warnings

import torch

from megatron.core.fusions.compile import compile_available


def uses_weighted_squared_relu(config) -> bool:
    """The experts take this path (TransformerConfig checks that the activation is squared ReLU without GLU)."""
    return bool(getattr(config, "use_fused_weighted_squared_relu", False))


def weighted_squared_relu_eager(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 * probs[..., None] in fp32, in x's dtype; ``probs`` has x's shape without the last dim."""
    r = torch.relu(x.float())
    return (r * r * probs.float().unsqueeze(-1)).to(x.dtype)


_COMPILED = {}


def weighted_squared_relu(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`weighted_squared_relu_eager`, compiled on CUDA (inside a compiled region the caller's graph fuses it)."""
    if not x.is_cuda or torch.compiler.is_compiling() or not compile_available():
        return weighted_squared_relu_eager(x, probs)
    fn = _COMPILED.get("fn")
    if fn is None:
        fn = _COMPILED["fn"] = torch.compile(weighted_squared_relu_eager, dynamic=True)
    if fn is weighted_squared_relu_eager:
        return fn(x, probs)
    try:
        return fn(x, probs)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 (any compiler failure: the eager form computes the same)
        warnings.warn(f"--use-fused-weighted-squared-relu: torch.compile failed ({type(e).__name__}: {e}); "
                      "using the eager activation")
        _COMPILED["fn"] = weighted_squared_relu_eager
        return weighted_squared_relu_eager(x, probs)
