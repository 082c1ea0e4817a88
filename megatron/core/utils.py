"""Small helpers shared across megatron.core: devices, tensor utilities, model unwrapping."""
import importlib
import operator
import os
import sys
from functools import reduce
from typing import Any, List, Optional

import torch


def lazy_names(host: str, table: dict):
    """A PEP 562 module ``__getattr__`` for ``host`` that resolves each name in ``table`` on first use.

    ``table`` maps an attribute name to the module that defines it (``{"name": "megatron.core._compat.x"}``).
    This is how Megatron's import paths reach the compatibility rooms (``megatron/*/_compat/``) without a
    working module importing them: the room is imported only when a user's code asks for one of its
    names. The resolved value is cached on the host module.
    """

    def __getattr__(name: str):
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {host!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target), name)
        setattr(sys.modules[host], name, value)
        return value

    return __getattr__


def get_current_device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_device(local_rank: Optional[int] = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    return torch.device(f"cuda:{local_rank}")


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises if ``denominator`` does not divide ``numerator``."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def prod(values) -> int:
    return reduce(operator.mul, values, 1)


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """Walk ``.module`` wrappers (DDP, Float16Module) until one has ``attr``."""
    if isinstance(model, list):
        raise TypeError("get_attr_wrapped_model expects a single model chunk, not a list")
    while not hasattr(model, attr):
        if not hasattr(model, "module"):
            raise RuntimeError(f"no wrapped module has attribute '{attr}'")
        model = model.module
    if return_model_obj:
        return model
    value = getattr(model, attr)
    if value is None and not allow_none:
        raise RuntimeError(f"attribute '{attr}' is None")
    return value


def get_model_config(model):
    """The TransformerConfig of a (possibly wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(model, module_instances: Any = None):
    """Strip wrapper modules (anything exposing ``.module``) from a model or list of models."""
    models = model if isinstance(model, list) else [model]
    out = []
    for m in models:
        while hasattr(m, "module") and (module_instances is None or isinstance(m, module_instances)):
            m = m.module
        out.append(m)
    return out if isinstance(model, list) else out[0]


class MakeViewlessTensor(torch.autograd.Function):
    """Identity whose output owns no ``_base``, keeping the autograd graph."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
        out.data = inp.data
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """A tensor that is not a view, so a pipeline stage can free its output storage after sending it."""
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


def init_method_normal(sigma: float):
    """N(0, sigma) initializer."""
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """N(0, sigma / sqrt(multiplier * num_layers)) for output projections of residual branches."""
    std = sigma / (multiplier * num_layers) ** 0.5
    return init_method_normal(std)


def _version(dist_name: str, missing_ok: bool):
    """Installed version of a distribution; 0.0.0 when absent and `missing_ok` (as Megatron for TE)."""
    from importlib.metadata import PackageNotFoundError, version
    from packaging.version import Version
    try:
        return Version(version(dist_name))
    except PackageNotFoundError:
        if missing_ok:
            return Version("0.0.0")
        raise ImportError(f"{dist_name} is not installed")


def _at_least(current, wanted: str, check_equality: bool) -> bool:
    from packaging.version import Version
    return current >= Version(wanted) if check_equality else current > Version(wanted)


def get_torch_version():
    from packaging.version import Version
    return Version(torch.__version__.split("+")[0])


def is_torch_min_version(version, check_equality=True) -> bool:
    return _at_least(get_torch_version(), version, check_equality)


def get_te_version():
    """Transformer Engine's version, 0.0.0 without it (no code path here needs it)."""
    return _version("transformer-engine", missing_ok=True)


def is_te_min_version(version, check_equality=True) -> bool:
    return _at_least(get_te_version(), version, check_equality)


def get_fa_version():
    return _version("flash-attn", missing_ok=False)


def is_fa_min_version(version, check_equality=True) -> bool:
    return _at_least(get_fa_version(), version, check_equality)


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def log_single_rank(logger, *args, rank: int = 0, **kwargs) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == rank:
        logger.log(*args, **kwargs)


def get_tensor_list(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t for t in tensors if t is not None]


from megatron.core._utils_extras import *  # noqa: E402,F401,F403  (less common helpers)
from megatron.core._utils_batch import *  # noqa: E402,F401,F403  (TP batch broadcast, packed-batch flattening)
from megatron.core._utils_wgrad import *  # noqa: E402,F401,F403  (deferred embedding wgrad helpers)


class StragglerDetector:
    """Megatron's per-rank straggler timer, in its default disabled state.

    Megatron's ``pretrain_gpt.py`` creates one at import (``stimer = StragglerDetector()``) and times
    ``with stimer:`` / ``with stimer(bdata=True):`` blocks; until ``configure(..., enabled=True)`` (from
    --log-straggler) those blocks time nothing there either. Enabling it is refused: the CUDA-event
    timing reports are not implemented here.
    """

    def __init__(self):
        self.enabled = False

    def configure(self, world: int, rank: int, mmcnt: int = 1, amp: float = 3.0, port: int = 65535,
                  prefill: int = 1024, enabled: bool = False) -> None:
        if enabled:
            raise NotImplementedError("StragglerDetector (--log-straggler) timing reports are not implemented")

    def __call__(self, bdata: bool = False) -> "StragglerDetector":
        return self

    def __enter__(self) -> "StragglerDetector":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """False: nothing was reported (the detector is disabled), as Megatron returns when disabled."""
        return False


def get_batch_on_this_cp_rank(batch, is_hybrid_cp: bool = False, cp_group=None, hybrid_cp_group_func=None,
                              use_per_sequence_balancing: bool = False):
    """Megatron's signature for megatron.core.context_parallel.get_batch_on_this_cp_rank: this CP rank's
    load-balanced chunks of every [b, s] tensor of ``batch`` (over ``cp_group``, default the CP group)."""
    if is_hybrid_cp or hybrid_cp_group_func is not None or use_per_sequence_balancing:
        raise NotImplementedError("get_batch_on_this_cp_rank: hybrid CP and per-sequence balancing are not "
                                  "supported; leave is_hybrid_cp / hybrid_cp_group_func / "
                                  "use_per_sequence_balancing at their defaults")
    from megatron.core.context_parallel.utils import get_batch_on_this_cp_rank as _on_cp_rank
    if cp_group is None:
        return _on_cp_rank(batch)
    return _on_cp_rank(batch, torch.distributed.get_world_size(cp_group), torch.distributed.get_rank(cp_group))
