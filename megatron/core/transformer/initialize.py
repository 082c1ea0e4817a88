"""Layout-independent parameter initialization.

A parameter's values depend only on (config.seed, its global name): the name it has in a TP=PP=1
model. For each parameter we seed a generator from a hash of (seed, name), fill the full global
tensor with the parameter's ``init_fn`` and copy out this rank's TP slice. The slice follows
``partition_dim`` and ``partition_stride`` (stride k: k interleaved blocks, each split over TP, as
SwiGLU's [gate; up]) or ``partition_sizes`` (fused parts of different sizes, each split over TP, as the
SSM mixers' in_proj); the fused QKV needs nothing special since TP splits whole query groups.
"""
import hashlib
import re
from typing import Dict

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_home_device
from megatron.core.transformer import te_key_map

_LAYER_RE = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")


def global_param_names(model: torch.nn.Module, keep_vars: bool = True) -> Dict[str, str]:
    """{local state-dict name: global (TP=PP=1) name}. Layer indices become ``layer_number - 1``;
    an output layer tied to the embedding maps to ``embedding.word_embeddings.weight``."""
    layer_numbers = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_number") and _LAYER_RE.match(name + "."):
            layer_numbers[name] = module.layer_number
    # SequentialMLP experts: local index -> global expert index (EP rank m holds m * E_local + i).
    expert_maps = {(name + "." if name else "") + "experts.local_experts.": module.local_expert_indices
                   for name, module in model.named_modules()
                   if hasattr(module, "local_expert_indices") and hasattr(module.experts, "local_experts")}
    out = {}
    with te_key_map.local_names(model):  # init seeds and checkpoint layouts key params by their local names
        local_keys = list(model.state_dict(keep_vars=keep_vars))
    for local in local_keys:
        name = _global_expert_name(local, expert_maps)
        m = _LAYER_RE.match(name)
        if m:
            layer_path = m.group(1) + m.group(2)
            if layer_path in layer_numbers:
                name = f"{m.group(1)}{layer_numbers[layer_path] - 1}{m.group(3)}"
        out[local] = name
    if getattr(model, "share_embeddings_and_output_weights", False) and "output_layer.weight" in out:
        out["output_layer.weight"] = "embedding.word_embeddings.weight"
    return out


def _global_expert_name(local: str, expert_maps) -> str:
    for prefix, indices in expert_maps.items():
        if local.startswith(prefix):
            index, rest = local[len(prefix):].split(".", 1)
            return f"{prefix}{indices[int(index)]}.{rest}"
    return local


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _coords(pg_collection, name: str, rank_getter, size_getter):
    """(rank, size) along axis ``name``: in the explicit collection's group, else parallel_state's."""
    if pg_collection is None:
        return rank_getter(), size_getter()
    group = getattr(pg_collection, name)
    if group is None:
        raise ValueError(f"initialize_parameters: the explicit pg_collection has no '{name}' group, which "
                         "slices the parameters; set it (a one-rank group if that axis is not split)")
    return group.rank(), group.size()


def tp_rank_and_size(param, pg_collection=None):
    """TP coordinates of a parameter (expert params live on the expert-TP group)."""
    if getattr(param, "allreduce", True):
        return _coords(pg_collection, "tp", parallel_state.get_tensor_model_parallel_rank,
                       parallel_state.get_tensor_model_parallel_world_size)
    return _coords(pg_collection, "expt_tp", parallel_state.get_expert_tensor_parallel_rank,
                   parallel_state.get_expert_tensor_parallel_world_size)


def _ep_rank_and_size(pg_collection=None):
    return _coords(pg_collection, "ep", parallel_state.get_expert_model_parallel_rank,
                   parallel_state.get_expert_model_parallel_world_size)


def local_slice(full: torch.Tensor, param, pg_collection=None) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` for ``param`` (``pg_collection``: explicit groups)."""
    expert_dim = getattr(param, "expert_dim", None)
    if expert_dim is not None:  # stacked experts (GroupedMLP): this EP rank's block of experts
        ep_rank, ep = _ep_rank_and_size(pg_collection)
        full = full.chunk(ep, dim=expert_dim)[ep_rank]
    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank, size = tp_rank_and_size(param, pg_collection)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    sections = getattr(param, "partition_sizes", None)
    if sections is not None:  # fused parts of different sizes, each split over TP (Mamba's in_proj, conv1d)
        parts = full.split([n * size for n in sections], dim=dim)
        return torch.cat([part.chunk(size, dim=dim)[rank] for part in parts], dim=dim)
    blocks = full.chunk(stride * size, dim=dim)  # stride groups of `size` blocks each
    return torch.cat([blocks[s * size + rank] for s in range(stride)], dim=dim)


def global_shape(param, pg_collection=None):
    shape = list(param.shape)
    if getattr(param, "expert_dim", None) is not None:
        shape[param.expert_dim] *= _ep_rank_and_size(pg_collection)[1]
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_rank_and_size(param, pg_collection)[1]
    return shape


@torch.no_grad()
def materialize_meta_parameters(model: torch.nn.Module, device: torch.device) -> None:
    """--init-model-with-meta-device: every parameter still on the meta device becomes an uninitialized tensor on
    ``device`` (its attributes kept: init_fn, the TP layout, allreduce...; one tensor for a parameter two
    modules share), for `initialize_parameters` to fill."""
    made = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                new = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                         requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                made[id(param)] = new
            module._parameters[name] = made[id(param)]


def _generation_device(param, config):
    if config.use_cpu_initialization or param.device.type == "cpu":
        return torch.device("cpu")
    return param.device  # same values on every layout of this device type


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, seed=None, pg_collection=None, name_prefix: str = "") -> None:
    """Fill every parameter of ``model`` from (seed, global name), independently of the parallel layout
    (the slices of a model on explicit process groups follow ``pg_collection``). ``name_prefix``: the
    module's path inside a larger model (``vision_model.``), so that parts sharing names draw apart."""
    config = model.config
    seed = config.seed if seed is None else seed
    materialize_meta_parameters(model, param_home_device(config))
    names = global_param_names(model)
    params = dict(model.named_parameters())
    for local, param in params.items():
        init_fn = getattr(param, "init_fn", None)
        if init_fn is None:
            raise RuntimeError(f"parameter '{local}' has no init_fn; every module must record one")
        device = _generation_device(param, config)
        if getattr(param, "per_expert_name", None) is not None:
            _initialize_stacked_experts(param, names[local], seed, device, pg_collection)
            continue
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_name_seed(seed, name_prefix + names[local]))
            full = torch.empty(global_shape(param, pg_collection), dtype=param.dtype, device=device)
            init_fn(full)
        param.copy_(local_slice(full, param, pg_collection))


class _ExpertSlice:
    """The TP layout of one expert's matrix inside a stacked [E_local, ...] expert weight."""

    def __init__(self, param):
        self.tensor_model_parallel = param.tensor_model_parallel
        self.partition_dim = param.partition_dim - 1
        self.partition_stride = getattr(param, "partition_stride", 1)
        self.allreduce = False
        self.shape = param.shape[1:]


def _initialize_stacked_experts(param, global_name: str, seed: int, device, pg_collection=None) -> None:
    """Stacked expert weights (GroupedMLP) take, expert by expert, the values SequentialMLP's
    ``experts.local_experts.<g>.<per_expert_name>`` gets, so --moe-grouped-gemm does not change the model."""
    base = global_name.rsplit(".", 1)[0]  # ...mlp.experts
    layout = _ExpertSlice(param)
    first = _ep_rank_and_size(pg_collection)[0] * param.shape[0]
    devices = [device] if device.type == "cuda" else []
    for i in range(param.shape[0]):
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_name_seed(seed, f"{base}.local_experts.{first + i}.{param.per_expert_name}"))
            full = torch.empty(global_shape(layout, pg_collection), dtype=param.dtype, device=device)
            param.init_fn(full)
        param[i].copy_(local_slice(full, layout, pg_collection))
