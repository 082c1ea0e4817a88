"""Optimizer state <-> layout-independent sharded state dicts.

Every per-param state tensor (fp32 main param, exp_avg, exp_avg_sq, momentum_buffer) is saved as a
`ShardedTensor` with the model param's global shape and offset under the key
`optimizer.state.<name>.<param key>`, so optimizer state reshards exactly like the model weights
(TP/PP/DP changes, distributed optimizer on or off). Scalars (step, hyper-parameters, loss scale)
go in the common part.
"""
import dataclasses
from typing import Dict

import torch

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
    param_state = opt.param_state_for_save()
    param_to_st = _param_to_sharded_tensor(model_sharded_state_dict, list(param_state))
    sharded = {}
    opt._sharded_key_to_param = {}
    for param, state in param_state.items():
        st = param_to_st.get(param)
        if st is None:
            raise ValueError("optimizer param has no entry in the model's sharded_state_dict; "
                             "pass the sharded_state_dict of the same model chunks the optimizer was built on")
        opt._sharded_key_to_param[st.key] = param
        entry = {}
        for name, tensor in state.items():
            data = torch.empty_like(tensor) if is_loading else tensor
            if data.shape != st.data.shape and data.numel() == st.data.numel():
                data = data.reshape(st.data.shape)  # the model's saved view of this param
            # A factory (a param saved in parts) builds the same parts of its optimizer state.
            dtype = {} if isinstance(st, ShardedTensorFactory) else {"dtype": data.dtype}
            entry[name] = dataclasses.replace(st, key=f"optimizer.state.{name}.{st.key}", data=data, **dtype)
        sharded[st.key] = entry
    out = _common_state(opt)
    out["param_state"] = sharded
    return out


def _as_param_shape(t, param):
    """Undo the model's saved view (see `_param_to_sharded_tensor`) for tensors shaped like the param."""
    if torch.is_tensor(t) and t.dim() > 0 and t.shape != param.shape and t.numel() == param.numel():
        return t.reshape(param.shape)
    return t


def load_sharded(opt, state_dict: Dict):
    """Inverse of `sharded_state_dict`, given the same structure with tensors filled in."""
    if state_dict["param_state_sharding_type"] != SHARDING_TYPE:
        raise ValueError(f"unknown optimizer sharding type {state_dict['param_state_sharding_type']}")
    key_to_param = getattr(opt, "_sharded_key_to_param", None)
    if key_to_param is None:
        raise ValueError("call optimizer.sharded_state_dict(model_sd, is_loading=True) before loading it")
    loaded = {}
    for key, entry in state_dict["param_state"].items():
        param = key_to_param[key]
        loaded[param] = {name: _as_param_shape(t.data if isinstance(t, ShardedTensor) else t, param)
                         for name, t in entry.items()}
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
