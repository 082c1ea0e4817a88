"""torch.compile helpers for small element-wise functions, only where a GPU compiler backend is available
(``transformer_layer.compile_transformer_layers`` compiles whole layers with the same settings)."""
import functools
import os

import torch

from megatron.core.utils import lazy_names


def compile_available() -> bool:
    """Inductor needs Triton on CUDA; CPU runs stay eager (a C++ compile per test would dwarf the tests)."""
    if os.environ.get("MEGATRON_DISABLE_COMPILE", "0") == "1":
        return False
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401  # lazy: optional dependency, probed only on CUDA
    except ImportError:
        return False
    return True


def maybe_compile(fn=None, **compile_kwargs):
    """Decorator: ``torch.compile(fn)`` built lazily on first CUDA call; eager on CPU tensors."""
    def wrap(f):
        compiled = None

        @functools.wraps(f)
        def inner(*args, **kwargs):
            nonlocal compiled
            first = next((a for a in args if torch.is_tensor(a)), None)
            # Inside a compiled region (a compiled layer) the caller's graph fuses it already.
            if (first is None or not first.is_cuda or torch.compiler.is_compiling()
                    or not compile_available()):
                return f(*args, **kwargs)
            if compiled is None:
                _raise_recompile_limit()
                compiled = torch.compile(f, dynamic=False, **compile_kwargs)
            return compiled(*args, **kwargs)
        inner.eager = f
        return inner
    return wrap(fn) if fn is not None else wrap


def _raise_recompile_limit(limit: int = 64) -> None:
    """One static-shape graph per (shape, dtype) a helper sees, e.g. FP8 quantization of every linear's
    input, weight and grad: more than torch's default of 8, past which it would silently run eager."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


# compile_transformer_layers lives with TransformerLayer now; this old path still resolves to it.
__getattr__ = lazy_names(__name__, {"compile_transformer_layers": "megatron.core.transformer.transformer_layer"})
