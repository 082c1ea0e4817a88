"""Everything that must happen to the grads between the last backward and the optimizer step."""
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.torch_fsdp2_state import local_tensor
from megatron.core.process_groups_config import get_pg, get_pg_size
from megatron.core.transformer.moe.router import finalize_router_state
from megatron.core.utils import lazy_names

# Megatron's reset of per-step router statistics, which the loop here does not call, resolved on first use.
__getattr__ = lazy_names(__name__, {"reset_model_temporary_tensors": "megatron.core._compat.finalize_model_grads"})


def _unwrap(model_chunk):
    while hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module
    return model_chunk


def _grad_of(param):
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def _timer(config, name):
    timers = getattr(config, "timers", None)
    if timers is None:
        return None
    return timers(name, log_level=1)


def _start(config, name):
    timer = _timer(config, name)
    if timer is not None:
        timer.start(barrier=getattr(config, "barrier_with_L1_time", False))


def _stop(config, name):
    timer = _timer(config, name)
    if timer is not None:
        timer.stop()


@torch.no_grad()
def _allreduce_grads_coalesced(grads, group):
    """One all-reduce for many grads: flatten, reduce, copy back.

    FSDP2 grads are DTensors sharded over DP: reduce their local shards, which cover the same
    elements on every rank of a TP or embedding group (those ranks share a DP rank)."""
    grads = [local_tensor(g) for g in grads]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _allreduce_layernorm_grads(model: List[torch.nn.Module], config, pg_collection=None):
    """Sequence parallelism leaves partial grads on TP-replicated params (norms, row-parallel bias)."""
    if get_pg_size(pg_collection, "tp", "finalize_model_grads") == 1:
        return
    # Flagged params: norms under SP, and weights replicated over TP that act on TP-split heads (q/k
    # layernorm, Gated DeltaNet's per-head output norm) or on a TP slice of the tokens (MoE routers).
    # MLA's latent norms see replicated inputs: flagged under SP only.
    grads = [_grad_of(p) for chunk in model for p in chunk.parameters()
             if p.requires_grad and _grad_of(p) is not None and getattr(p, "sequence_parallel", False)]
    _allreduce_grads_coalesced(grads, get_pg(pg_collection, "tp", "finalize_model_grads"))


def _allreduce_embedding_grads(model: List[torch.nn.Module], config, pg_collection=None):
    """Tied word embeddings live on the first and last PP stage: sum their grads over both (over the
    ``embd`` group of an explicit collection, left unset on the ranks holding no embedding)."""
    if get_pg_size(pg_collection, "pp", "finalize_model_grads") == 1:
        return
    if pg_collection is None:
        if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            return
        group = parallel_state.get_embedding_group()
    else:
        group = pg_collection.embd
        if group is None:
            return
    grads = []
    for chunk in model:
        for param in chunk.parameters():
            if param.requires_grad and getattr(param, "shared_embedding", False):
                grad = _grad_of(param)
                if grad is not None and not any(grad is g for g in grads):
                    grads.append(grad)
    _allreduce_grads_coalesced(grads, group)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                         pg_collection=None, force_all_reduce: bool = False):
    """Finish DP grad sync, reduce SP-replicated and tied-embedding grads, and (per-token loss)
    divide every grad by the global number of tokens. Groups: ``pg_collection``'s tp, pp, embd (on the
    ranks holding tied embeddings) and dp_cp, else parallel_state's (the DP reduction itself runs over
    the groups each DDP chunk was built with). `force_all_reduce` is refused."""
    if force_all_reduce:
        raise NotImplementedError("finalize_model_grads(force_all_reduce=True) is not supported; leave it False")
    config = getattr(_unwrap(model[0]), "config", None) or getattr(model[0], "config", None)

    _start(config, "all-grads-sync")
    for chunk in model:
        chunk.finish_grad_sync()
    _stop(config, "all-grads-sync")

    _start(config, "layernorm-grads-all-reduce")
    _allreduce_layernorm_grads(model, config, pg_collection)
    _stop(config, "layernorm-grads-all-reduce")

    _start(config, "embedding-grads-all-reduce")
    _allreduce_embedding_grads(model, config, pg_collection)
    _stop(config, "embedding-grads-all-reduce")

    if getattr(config, "num_moe_experts", None):
        finalize_router_state([_unwrap(chunk) for chunk in model], config)

    if num_tokens is not None:
        # Only the last stage counted tokens: share its count along the pipeline, then sum over DP x CP.
        if pg_collection is None:
            dist.broadcast(num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
            dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        else:
            pp_group = get_pg(pg_collection, "pp", "finalize_model_grads")
            dist.broadcast(num_tokens, src=dist.get_global_rank(pp_group, pp_group.size() - 1), group=pp_group)
            dist.all_reduce(num_tokens, group=get_pg(pg_collection, "dp_cp", "finalize_model_grads"))
        # 1 / tokens on the device (no tokens: 1 / 1, grads unchanged): reading the count back here would be
        # a host synchronisation before the optimizer step's launches.
        scaling = 1.0 / num_tokens.clamp(min=1).float()
        for chunk in model:
            chunk.scale_gradients(scaling)
