"""QK-clip (MuonClip's second half, Megatron's `clip_qk`): after the optimizer step, shrink the query and key
projections of the query groups whose max pre-softmax attention logit exceeded ``qk_clip_threshold``.

Megatron runs it after any optimizer (not only Muon) when ``--qk-clip`` is set; with
``--log-max-attention-logit`` alone it only reads and resets the recorded maxima. Each core attention records
the max over its rank's queries and heads (`DotProductAttention.current_max_attn_logits`); here the DP x CP
max is taken (one all-reduce for every layer), so that all replicas clip alike, and each TP rank clips its
own heads, each pipeline stage its own layers.
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def _attentions(model):
    """Modules that own a recording core attention, in module order (self-attention of every layer,
    MTP layers included)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules()
            if hasattr(getattr(m, "core_attention", None), "current_max_attn_logits")]


def _finish_param_gathers(model):
    """With --overlap-param-gather the distributed optimizer's all-gather of the updated params may still be
    in flight: wait for it, or it would overwrite the clipped weights with the unclipped shards."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()


@torch.no_grad()
def clip_qk(model, log_max_only: bool = False, optimizer=None, dp_cp_group=None, mp_group=None) -> float:
    """Reduce each layer's recorded max attention logits over DP x CP, clip (unless ``log_max_only``) and
    reset them; return the max over the whole model (every layer and head of every TP / PP rank).

    ``model``: the model chunks. ``optimizer``: its fp32 main copies of the QKV weights (`main_param_ranges`)
    are clipped with the weights; without it only ``param.main_param`` copies are (Megatron's behaviour), so
    pass it with a mixed-precision or distributed optimizer. Groups default to parallel_state's. Megatron
    returns this rank's layers' max only; here the value is reduced over the model-parallel group as well,
    so every rank logs the whole model's max. Negative maxima log as 0, as in Megatron.
    """
    attentions = [a for a in _attentions(model) if a.core_attention.current_max_attn_logits is not None]
    dp_cp_group = dp_cp_group or parallel_state.get_data_parallel_group(with_context_parallel=True)
    mp_group = mp_group or parallel_state.get_model_parallel_group()
    if attentions:
        maxima = [a.core_attention.current_max_attn_logits for a in attentions]
        flat = torch.cat(maxima)  # one all-reduce for every layer of this rank
        if dist.get_world_size(dp_cp_group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=dp_cp_group)
        for a, m in zip(attentions, flat.split([m.numel() for m in maxima])):
            a.core_attention.current_max_attn_logits = m
        local = flat.max().clamp(min=0.0)
    else:
        local = torch.zeros((), device=_device(model))
    if not log_max_only and attentions:
        _finish_param_gathers(model)
        ranges = _main_ranges(optimizer)
        for a in attentions:
            if hasattr(a, "clip_qk"):
                weight = a.linear_qkv.weight
                a.clip_qk(ranges.get(id(weight), []) if optimizer is not None else _megatron_main_param(weight))
    for a in attentions:  # clip_qk resets its own; log-only runs reset here
        a.core_attention.current_max_attn_logits = None
    if dist.get_world_size(mp_group) > 1:
        local = local.reshape(1)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mp_group)
    return float(local.max())


def _device(model):
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def _main_ranges(optimizer) -> dict:
    """{id(model param): [(main, start, end)]} from the optimizer's `main_param_ranges`."""
    out = {}
    if optimizer is None or not hasattr(optimizer, "main_param_ranges"):
        return out
    for main, model, start, end in optimizer.main_param_ranges():
        out.setdefault(id(model), []).append((main, start, end))
    return out


def _megatron_main_param(weight) -> list:
    """Megatron's fallback: a whole fp32 copy at ``weight.main_param`` (the mixed-precision optimizer's)."""
    main: Optional[torch.Tensor] = getattr(weight, "main_param", None)
    if main is None or main.data_ptr() == weight.data_ptr():
        return []
    return [(main, 0, weight.numel())]
