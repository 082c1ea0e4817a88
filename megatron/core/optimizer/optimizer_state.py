"""Optimizer state <-> layout-independent sharded state dicts.

Every per-param state tensor (fp32 main param, exp_avg, exp_avg_sq, momentum_buffer) is saved as a
`ShardedTensor` with the model param's global shape and offset under the key
`optimizer.state.<name>.<param key>`, so optimizer state reshards exactly like the model weights
(TP/PP/DP changes, distributed optimizer on or off). Scalars (step, hyper-parameters, loss scale)
go in the common part.
"""
import dataclasses
import math
from typing import Dict, List, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.distributed.torch_fsdp2_state import fsdp2_gathered_storage, is_dtensor

SHARDING_TYPE = "fully_reshardable"
_HYPER_PARAMS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov", "amsgrad",
                 "max_lr", "min_lr", "wd_mult", "lr_mult", "is_decoupled_lr", "is_expert_parallel")


def init_state(opt):
    """Create zero state for every main param that has none yet (so it can be saved or loaded into);
    the optimizer's own ``init_state_fn`` (Megatron's argument) runs first when given. A ChainedOptimizer
    initialises each of its optimizers."""
    if hasattr(opt, "chained_optimizers"):
        for part in opt.chained_optimizers:
            init_state(part)
        return
    inner = opt.optimizer
    fresh = any(not inner.state[p] for group in inner.param_groups for p in group["params"])
    if fresh and getattr(opt, "init_state_fn", None) is not None:
        opt.init_state_fn(inner, opt.config)
    for group in inner.param_groups:
        for p in group["params"]:
            if inner.state[p]:
                continue
            if hasattr(inner, "init_state"):  # TensorParallelMuon
                inner.init_state(p)
            elif isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam
                on_device = group.get("fused") or group.get("capturable")
                inner.state[p]["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                                          else torch.tensor(0.0, dtype=torch.float32))
                inner.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif isinstance(inner, torch.optim.SGD) and group.get("momentum", 0) != 0:
                # A zero buffer gives the same first step as torch's lazy `buf = grad` (dampening 0).
                inner.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _group_step(inner, group):
    for p in group["params"]:
        step = inner.state.get(p, {}).get("step")
        if step is not None:
            return float(step)
    return 0.0


def _common_state(opt):
    groups = []
    for group in opt.optimizer.param_groups:
        saved = {k: group[k] for k in _HYPER_PARAMS if k in group}
        saved["step"] = _group_step(opt.optimizer, group)
        groups.append(saved)
    # Groups with params on no rank of a stage still exist everywhere: the step must agree globally.
    common = {"param_groups": groups, "param_state_sharding_type": SHARDING_TYPE}
    if opt.grad_scaler is not None:
        common["grad_scaler"] = opt.grad_scaler.state_dict()
    return common


def _param_to_sharded_tensor(model_sharded_state_dict: Dict, params):
    """Match each param to the model's ShardedTensor describing it (by identity, else by storage).

    Storage is (data pointer, numel): a ShardedTensor may hold a reshaped view of its param (SwiGLU fc1
    is saved as [2, ffn, hidden] so both halves reshard by TP rank).
    """
    by_id = {id(p): p for p in params}
    by_storage = {(p.data_ptr(), p.numel()): p for p in params if not is_dtensor(p)}
    for p in params:  # FSDP2: the model saved the whole local-TP tensor gathered from this param
        gathered = fsdp2_gathered_storage(p)
        if gathered is not None:
            by_storage[gathered] = p
    found = {}

    def visit(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None:
            p = by_id.get(id(value.data))
            if p is None:
                p = by_storage.get((value.data.data_ptr(), value.data.numel()))
            if p is not None and p not in found:
                found[p] = value
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(model_sharded_state_dict)
    return found


def sharded_state_dict(opt, model_sharded_state_dict: Dict, is_loading: bool = False) -> Dict:
    """The optimizer's state as ShardedTensors over the live state tensors: a load (``is_loading``) reads straight
    into them, so no second copy of the state is held on the device, except the fp32 main params, which get
    their own read buffer (see _dp_sharded_param_state)."""
    if hasattr(opt, "local_param_state"):  # distributed optimizer: each DP rank saves its own range
        sharded = _dp_sharded_param_state(opt, model_sharded_state_dict, is_loading)
    else:
        sharded = {}
        opt._sharded_key_to_param = {}
        param_state = opt.param_state_for_save()
        param_to_st = _matching_sharded_tensors(model_sharded_state_dict, list(param_state))
        for param, state in param_state.items():
            sharded[param_to_st[param].key] = _whole_entry(opt, param, param_to_st[param], state, is_loading)
    out = _common_state(opt)
    out["param_state"] = sharded
    return out


def _matching_sharded_tensors(model_sharded_state_dict: Dict, params):
    param_to_st = _param_to_sharded_tensor(model_sharded_state_dict, params)
    if any(p not in param_to_st for p in params):
        raise ValueError("optimizer param has no entry in the model's sharded_state_dict; "
                         "pass the sharded_state_dict of the same model chunks the optimizer was built on")
    return param_to_st


def _whole_entry(opt, param, st, state, is_loading):
    """{state name: ShardedTensor like the param's ``st``} for a param's whole (TP-local) state."""
    opt._sharded_key_to_param[st.key] = param
    entry = {}
    for name, tensor in state.items():
        # A load reads into the live state (or the gathered copy set_param_state_from_load applies), except the
        # fp32 main params: see _dp_sharded_param_state.
        data = torch.empty_like(tensor) if is_loading and name == "fp32_param" else tensor
        if data.shape != st.data.shape and data.numel() == st.data.numel():
            data = data.reshape(st.data.shape)  # the model's saved view of this param
        # A factory (a param saved in parts) builds the same parts of its optimizer state.
        dtype = {} if isinstance(st, ShardedTensorFactory) else {"dtype": data.dtype}
        entry[name] = dataclasses.replace(st, key=f"optimizer.state.{name}.{st.key}", data=data, **dtype)
    return entry


def _dp_sharded_param_state(opt, model_sharded_state_dict: Dict, is_loading: bool) -> Dict:
    """The distributed optimizer's state with no gather: each DP rank describes only its flat range of each
    param, as boxes of the param's global tensor (`flat_range_boxes`), so every rank writes (and on load reads)
    its own part and the checkpoint reshards like the full per-param tensors. Params the model saves through
    a factory (in parts, e.g. Mamba's sectioned in_proj) are gathered whole and written by DP rank 0."""
    params = list(opt.param_to_buffer_bucket)
    param_to_st = _matching_sharded_tensors(model_sharded_state_dict, params)
    opt._sharded_key_to_param = {}
    factory_params = [p for p in params if isinstance(param_to_st[p], ShardedTensorFactory)]
    sharded = {}
    # Collective over every rank (the same call everywhere, even with no factory param).
    for param, state in opt.param_state_for_save(factory_params).items():
        sharded[param_to_st[param].key] = _whole_entry(opt, param, param_to_st[param], state, is_loading)
    for param, (lo, hi, state) in opt.local_param_state().items():
        st = param_to_st[param]
        if isinstance(st, ShardedTensorFactory):
            continue
        opt._sharded_key_to_param[st.key] = param
        # Loading reads straight into the live moments (no second copy of the optimizer state on the device:
        # 48 GB per GPU for Llama-3-8B at TP=2 would not fit beside it). Not into the fp32 main params: Megatron's
        # library pattern (model load, reload_model_params, optimizer load) refreshes them from the bf16 weights
        # between the read and `load_sharded`, which would round the loaded values (see _main_param_read_buffer).
        instance = _optimizer_instance(param)
        sharded[st.key] = {
            name: _range_pieces(st, f"optimizer.state.{name}.{st.key}", lo, hi,
                                _main_param_read_buffer(param, lo, hi, flat)
                                if is_loading and name == "fp32_param" else flat, instance)
            for name, flat in state.items()}
    return sharded


def _main_param_read_buffer(param, lo: int, hi: int, main_flat: torch.Tensor) -> torch.Tensor:
    """Where a load reads the fp32 main params of ``param``'s range [lo, hi): that range of the param's fp32 gradient
    buffer (``main_grad``), which holds nothing a load needs (every step zeroes it before its backward) and has
    the same size, so the load allocates no 16 GB per GPU (Llama-3-8B, TP=2) for them; a new buffer where the
    gradient is not an fp32 tensor of the param's shape (--grad-reduce-in-bf16, no gradient buffer)."""
    grad = getattr(param, "main_grad", None)
    if (torch.is_tensor(grad) and grad.dtype == torch.float32 and grad.shape == param.shape
            and grad.is_contiguous() and grad.device == main_flat.device):
        return grad.detach().view(-1)[lo:hi]
    return torch.empty_like(main_flat)


def flat_range_boxes(shape, lo: int, hi: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """[(offset, size)]: the boxes of a row-major tensor of ``shape`` that cover its flat range [lo, hi) in
    order, each a contiguous run of that range (at most 2 x dims - 1: a partial first row, whole rows, a
    partial last row, recursively)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)
    row = lambda r, a, b: [((r,) + o, (1,) + z) for o, z in flat_range_boxes(shape[1:], a, b)]  # noqa: E731
    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


def _optimizer_instance(param) -> int:
    """This rank's distributed-optimizer instance for ``param`` (0 with one instance): the ranks of the other
    instances hold the same range of its state, and only instance 0's copy is written."""
    group = parallel_state.get_inter_distributed_optimizer_instance_group(
        expert=not getattr(param, "allreduce", True))
    return 0 if group is None else torch.distributed.get_rank(group=group)


def _replica_without_dp(replica_id, instance: int = 0):
    """The model tensor's replica id with its DP part (the last) set to the distributed-optimizer instance: a DP
    rank's range is its own within its instance, and the instances hold copies of it."""
    return tuple(replica_id[:-1]) + (instance,) if isinstance(replica_id, (tuple, list)) else instance


def _range_pieces(st: ShardedTensor, key: str, lo: int, hi: int, flat: torch.Tensor, instance: int = 0) -> Dict:
    """{flat start: ShardedTensor} for the range [lo, hi) of the param that ``st`` describes (its local shape,
    whose row-major order is the param's), with ``flat`` the state of that range; ``instance``: this rank's
    distributed-optimizer instance (the copy's replica number)."""
    shape, n = tuple(st.local_shape), st.prepend_axis_num
    whole = (lo, hi) == (0, math.prod(shape))
    pieces = {}
    for offset, size in flat_range_boxes(shape, lo, hi):
        start = sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offset))
        data = flat[start - lo:start - lo + math.prod(size)].view(size)
        pieces[start] = dataclasses.replace(
            st, key=key, data=data, dtype=data.dtype, local_shape=tuple(size),
            global_offset=tuple(st.global_offset[:n]) + tuple(g + o for g, o in zip(st.global_offset[n:], offset)),
            axis_fragmentations=st.axis_fragmentations if whole else None,
            replica_id=_replica_without_dp(st.replica_id, instance))
    return pieces


def _as_param_shape(t, param):
    """Undo the model's saved view (see `_param_to_sharded_tensor`) for tensors shaped like the param."""
    if torch.is_tensor(t) and t.dim() > 0 and t.shape != param.shape and t.numel() == param.numel():
        return t.reshape(param.shape)
    return t


def _loaded_value(t, param):
    """A whole param's loaded state in the param's shape, or a range's pieces ({flat start: tensor}) joined."""
    if isinstance(t, dict):
        pieces = [t[k] for k in sorted(t)]
        joined = _adjacent_view(pieces)
        # Pieces read in place into one flat tensor (the live moments) are that tensor again: joining them with
        # torch.cat would hold a second copy of every param's state at once (48 GB per GPU for Llama-3-8B's
        # three fp32 states at TP=2), which does not fit beside the model on the device.
        return joined if joined is not None else torch.cat([p.reshape(-1) for p in pieces])
    return _as_param_shape(t.data if isinstance(t, ShardedTensor) else t, param)


def _adjacent_view(pieces):
    """One flat view over ``pieces`` when they lie back to back, in order, in one storage (else None)."""
    first = pieces[0]
    if not all(torch.is_tensor(p) and p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in pieces):
        return None
    offset = first.storage_offset()
    for p in pieces:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    flat = first.new_empty(0)
    return flat.set_(first.untyped_storage(), first.storage_offset(), (offset - first.storage_offset(),))


def load_sharded(opt, state_dict: Dict):
    """Inverse of `sharded_state_dict`, given the same structure with tensors filled in."""
    if state_dict["param_state_sharding_type"] != SHARDING_TYPE:
        raise ValueError(f"unknown optimizer sharding type {state_dict['param_state_sharding_type']}")
    key_to_param = getattr(opt, "_sharded_key_to_param", None)
    if key_to_param is None:
        raise ValueError("call optimizer.sharded_state_dict(model_sd, is_loading=True) before loading it")
    loaded = {}
    # A rank whose shards hold none of this optimizer's params (a small expert buffer over many DP ranks) asked for
    # an empty dict, which the load does not return.
    for key, entry in state_dict.get("param_state", {}).items():
        param = key_to_param[key]
        loaded[param] = {name: _loaded_value(t, param) for name, t in entry.items()}
    opt.set_param_state_from_load(loaded)
    groups = opt.optimizer.param_groups
    if len(state_dict["param_groups"]) != len(groups):
        raise ValueError(f"checkpoint has {len(state_dict['param_groups'])} optimizer param groups, this run "
                         f"has {len(groups)}; use --no-load-optim to start the optimizer fresh")
    for group, saved in zip(groups, state_dict["param_groups"]):
        saved = dict(saved)
        step = saved.pop("step", None)
        group.update({k: v for k, v in saved.items() if k in group})
        for p in group["params"]:
            if step is not None and "step" in opt.optimizer.state[p]:
                opt.optimizer.state[p]["step"].fill_(step)
    if opt.grad_scaler is not None and state_dict.get("grad_scaler"):
        opt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
