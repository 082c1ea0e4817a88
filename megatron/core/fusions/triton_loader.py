"""Lazy, memoized import of a module's Triton kernels: they exist only where Triton can build them."""
from typing import Any, Callable


def triton_loader(load: Callable[[], Any]) -> Callable[[], Any]:
    """``load()`` once (it imports a Triton kernel module and returns what the caller needs); the result,
    or False where that import fails (CPU builds without Triton, or a Triton that cannot build kernels)."""
    state = {}

    def get():
        if "impl" not in state:
            try:
                state["impl"] = load()
            except Exception:  # noqa: BLE001 (any import or build failure means: no kernels here)
                state["impl"] = False
        return state["impl"]
    return get
