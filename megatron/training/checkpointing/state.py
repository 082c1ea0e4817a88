"""What a checkpoint holds (COMPAT 6.2): args, iteration, model, optimizer, scheduler, RNG, counters."""
import random
from typing import Any, Dict, List

import numpy as np
import torch

from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

CHECKPOINT_VERSION = 3.0


def layout() -> Dict[str, int]:
    """This rank's (tp, pp, dp) ranks and sizes; a single-rank layout when groups are not set up."""
    if not ps.model_parallel_is_initialized():
        return dict(tp=0, tp_size=1, pp=0, pp_size=1, dp=0, dp_size=1)
    return dict(tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                dp=ps.get_data_parallel_rank(with_context_parallel=True),
                dp_size=ps.get_data_parallel_world_size(with_context_parallel=True))


def get_rng_state() -> Dict[str, Any]:
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    state["rng_tracker_states"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states"):
        get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def sharded_rng_state(rng_state: Dict[str, Any]) -> ShardedObject:
    """One RNG state per (PP, TP) rank, replicated across DP (DP rank 0 writes it)."""
    lay = layout()
    return ShardedObject("rng_state", [rng_state], (lay["pp_size"], lay["tp_size"]), (lay["pp"], lay["tp"]),
                         replica_id=lay["dp"])


def model_state(model: List[torch.nn.Module], sharded: bool, is_loading: bool = False) -> Dict[str, Any]:
    """``{'model': ...}`` or ``{'model0': ..., 'model1': ...}`` per virtual pipeline chunk."""
    out = {}
    for i, chunk in enumerate(model):
        m = unwrap_model(chunk)
        if sharded:
            sd = m.sharded_state_dict()
        elif hasattr(m, "state_dict_for_save_checkpoint"):
            sd = m.state_dict_for_save_checkpoint()
        else:
            sd = m.state_dict()
        out["model" if len(model) == 1 else f"model{i}"] = sd
    return out


def merged_model_sharded_sd(state: Dict[str, Any]) -> Dict[str, Any]:
    """All chunks' sharded state dicts in one dict (what the optimizer's sharded_state_dict expects)."""
    merged = {}
    for k, v in state.items():
        if k == "model" or (k.startswith("model") and k[5:].isdigit()):
            merged.update(v)
    return merged


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration: int,
                        num_floating_point_operations_so_far, sharded: bool, is_loading: bool = False,
                        save_optim: bool = True, save_rng: bool = True) -> Dict[str, Any]:
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
    state.update(model_state(model, sharded, is_loading))
    if save_optim and optimizer is not None:
        if sharded:
            state["optimizer"] = optimizer.sharded_state_dict(merged_model_sharded_sd(state), is_loading=is_loading)
        else:
            state["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if save_rng and rng_state is not None:
        state["rng_state"] = sharded_rng_state(rng_state) if sharded else [rng_state]
    if not is_loading:  # the rerun engine's decisions (skipped / stopped steps), kept with the run
        state["rerun_state_machine"] = get_rerun_state_machine().state_dict()
    return state
