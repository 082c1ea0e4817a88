"""Parameter helpers shared by the SSM mixers: TP-split parameters built from fused sections."""
import math
from typing import Callable, Sequence

import torch

from megatron.core.tensor_parallel.layers import _param_device


def tp_param(shape, config, init_fn: Callable, dtype=None, sections: Sequence = ()) -> torch.nn.Parameter:
    """A parameter split over TP along dim 0 whose values come from ``init_fn`` on the global tensor
    (transformer/initialize.py). ``sections``: (name, local size) of the fused parts, each split over TP
    on its own (``partition_sizes`` / ``partition_names``: checkpoints store one tensor per part)."""
    p = torch.nn.Parameter(torch.empty(*shape, dtype=dtype or config.params_dtype, device=_param_device(config)))
    if config.perform_initialization and not p.is_meta:
        init_fn(p.data)
    p.init_fn = init_fn
    p.allreduce = True
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
    if sections:
        set_partition_sections(p, sections)
    return p


def set_partition_sections(param, sections: Sequence) -> None:
    """Record that ``param`` (split over TP along ``partition_dim``) fuses parts of different sizes, each
    split over TP on its own: rank r holds [part_0 slice r, part_1 slice r, ...] (Megatron's attribute)."""
    names, sizes = zip(*sections)
    assert sum(sizes) == param.shape[param.partition_dim], (sections, param.shape)
    param.partition_sizes, param.partition_names = list(sizes), list(names)


def conv_init_fn(width: int, bound=None) -> Callable:
    """nn.Conv1d's default init for a depthwise kernel of ``width`` taps (fan_in = width), weight and bias:
    U(-1/sqrt(width), 1/sqrt(width)); U(-bound, bound) when ``bound`` is given (Megatron's conv_init)."""
    b = bound if bound is not None else 1.0 / math.sqrt(width)

    def init(t):
        return torch.nn.init.uniform_(t, -b, b)
    return init
