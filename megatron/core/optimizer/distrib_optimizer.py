"""ZeRO-1-style distributed optimizer: each DP rank updates only its 1/DP range of every DDP bucket.

DDP reduce-scatters each bucket's grads, so this rank holds the reduced grads of its own range.
The fp32 main params and the optimizer state exist only for that range; after the local step the
updated bf16/fp16/fp32 model params are all-gathered bucket by bucket (asynchronously, waited on by
forward pre-hooks, with `overlap_param_gather`).
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import optimizer_state
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    _model_grad,
    copy_optimizer_param_metadata,
    copy_tensor_model_parallel_attributes,
)
from megatron.core.utils import lazy_names

# Megatron's span type, which the optimizer here does not use (it keeps (start, end) tuples).
__getattr__ = lazy_names(__name__, {"Range": "megatron.core._compat.distrib_optimizer"})

# all_gather_single is newer than torch 2.4; all_gather_into_tensor is the same operation.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Megatron's constructor: the inner optimizer's params must live in `per_model_buffers`
    ({chunk index: [grad buffers]}, default: every buffer of `model_chunks`, dense and expert) and
    each buffer's DP group must be `data_parallel_group` when both are given. State gathers run over
    the buffers' own groups, so `data_parallel_group_gloo` and `data_parallel_group_idx` have no effect;
    with several distributed-optimizer instances (the buffers shard over one instance's part of the DP group)
    every instance steps on the same reduced shard, so `distributed_optimizer_instance_id` has no effect either.

    ``whole_params`` (the layer-wise distributed optimizer, Muon): the buffers keep every param whole
    inside one DP shard (DDP's layer-wise layout), and each main param keeps its param's shape, so the
    inner optimizer sees whole matrices; a param split across shards is an error."""

    def __init__(self, optimizer, config, grad_scaler, init_state_fn=None, model_chunks: List[torch.nn.Module] = (),
                 per_model_buffers: Optional[Dict[int, list]] = None, data_parallel_group=None,
                 data_parallel_group_gloo=None, data_parallel_group_idx: int = 0,
                 distributed_optimizer_instance_id: int = 0, whole_params: bool = False):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.whole_params = whole_params
        self.model_chunks = list(model_chunks)
        for chunk in self.model_chunks:
            if not hasattr(chunk, "buffers") or not chunk.ddp_config.use_distributed_optimizer:
                raise ValueError("--use-distributed-optimizer needs the model wrapped in DistributedDataParallel "
                                 "built with use_distributed_optimizer=True")
        all_buffers = {i: c.buffers + c.expert_parallel_buffers for i, c in enumerate(self.model_chunks)}
        if per_model_buffers is None:
            per_model_buffers = all_buffers
        self.per_model_buffers = per_model_buffers
        # Another optimizer owns the chunks' other buffers (Muon + AdamW): gather only these after a step.
        self._owns_all_buffers = all(len(per_model_buffers.get(i, [])) == len(b) for i, b in all_buffers.items())
        self.param_to_buffer_bucket = {}
        for buffers in per_model_buffers.values():
            for buffer in buffers:
                _check_group(buffer, data_parallel_group)
                for param, (start, end, bucket_id) in buffer.param_index_map.items():
                    self.param_to_buffer_bucket[param] = (buffer, buffer.buckets[bucket_id], start, end)
        # main param shard -> (model param, start, end) with [start, end) into model_param.view(-1)
        self.shard_ranges: Dict[torch.Tensor, tuple] = {}
        for group in self.optimizer.param_groups:
            mains = []
            for param in group["params"]:
                main = self._make_main_shard(param)
                if main is not None:
                    mains.append(main)
            group["params"] = mains

    def _make_main_shard(self, param):
        if param not in self.param_to_buffer_bucket:
            raise ValueError("DistributedOptimizer: a param of the inner optimizer is in none of the given grad "
                             "buffers (per_model_buffers / the DDP-wrapped model_chunks)")
        buffer, bucket, start, end = self.param_to_buffer_bucket[param]
        shard_start, shard_end = bucket.shard_range()
        shard_start, shard_end = bucket.offset + shard_start, bucket.offset + shard_end
        lo, hi = max(start, shard_start), min(end, shard_end)
        if lo >= hi:
            return None
        local = param.detach().view(-1)[lo - start:hi - start]
        if self.whole_params:
            if (lo, hi) != (start, end):
                raise ValueError("DistributedOptimizer(whole_params=True): a param is split across DP shards; "
                                 "tag the params (tag_params_for_buffer_routing) before wrapping them in DDP")
            local = local.view(param.shape)
        # fp32 model params are updated in place (the shard view aliases the param buffer); 16-bit ones get a master
        # copy in --main-params-dtype (fp32 unless the precision-aware optimizer asks for fp16).
        main = local if param.dtype == torch.float32 else local.clone().to(self.config.main_params_dtype)
        copy_tensor_model_parallel_attributes(main, param)
        copy_optimizer_param_metadata(main, param)
        self.main_to_model[main] = param
        self.shard_ranges[main] = (param, lo - start, hi - start)
        return main

    def get_grad_stats_parallel_group(self):
        # Grads are sharded over DP x CP as well (over this instance's part of it with several distributed-optimizer
        # instances, each of which holds the whole gradient): statistics need that group too.
        return [parallel_state.get_model_parallel_group(),
                parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)]

    def get_expert_grad_stats_parallel_group(self):
        # Expert grads are sharded over (this instance's part of) expert-DP as well.
        return [parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
                parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True)]

    def _copy_model_grads_to_main_grads(self):
        decoupled, dtype = self._decoupled_grads, self.config.main_grads_dtype
        for main, (model, lo, hi) in self.shard_ranges.items():
            grad = _model_grad(model)
            grad = None if grad is None else grad.view(-1)[lo:hi].view_as(main)
            if decoupled:  # the grad buffer's own shard when it has the dtype asked for: no copy
                main.decoupled_grad = None if grad is None else grad.to(dtype)
            else:
                main.grad = None if grad is None else grad.float()

    def _model_param_copies(self):
        copies = {}
        for main, (model, lo, hi) in self.shard_ranges.items():
            target = model.detach().view(-1)[lo:hi].view_as(main)
            copies[main] = None if target.data_ptr() == main.data_ptr() else target
        return copies

    def main_param_ranges(self):
        # fp32 params are their own main shard (a view of the param): nothing of their own to edit.
        return [(main, model, lo, hi) for main, (model, lo, hi) in self.shard_ranges.items()
                if main.data_ptr() != model.detach().view(-1)[lo:hi].data_ptr()]

    def _copy_main_params_to_model_params(self):
        for main, target in self._model_param_copies().items():
            if target is not None:
                target.copy_(main.detach())

    def _after_step(self):
        with self._timed("params-all-gather"):
            if self._owns_all_buffers:
                for chunk in self.model_chunks:
                    chunk.start_param_sync()
            else:
                self._start_own_param_sync()

    def _start_own_param_sync(self, force_sync: bool = False):
        """All-gather the updated params of this optimizer's buckets only (as a bucket group does), each buffer's
        last bucket first: buckets hold params in backward order, and the forward needs the first layers first."""
        for buffers in self.per_model_buffers.values():
            for buffer in buffers:
                async_op = buffer.ddp_config.overlap_param_gather and not force_sync
                for bucket in reversed(buffer.buckets):
                    bucket.finish_param_sync()
                    bucket.start_param_sync(async_op=async_op)
                    if not async_op:
                        bucket.finish_param_sync()

    def reload_model_params(self):
        for main, (model, lo, hi) in self.shard_ranges.items():
            source = model.detach().view(-1)[lo:hi].view_as(main)
            if source.data_ptr() != main.data_ptr():
                main.detach().copy_(source)

    # -- checkpointing ------------------------------------------------------------------------
    def local_param_state(self):
        """``{model param: (lo, hi, {state name: [hi - lo] fp32 tensor})}``: this rank's own flat range
        ``[lo, hi)`` of each param (into ``param.view(-1)``) and its state, no communication. A torch_dist
        save writes these pieces from every DP rank (optimizer_state.sharded_state_dict)."""
        optimizer_state.init_state(self)
        with_fp32 = any(p.dtype != torch.float32 for p in self.param_to_buffer_bucket)
        out = {}
        for main, (param, lo, hi) in self.shard_ranges.items():
            keys = sorted(k for k in self.optimizer.state[main] if k != "step") + (["fp32_param"] if with_fp32 else [])
            # fp32 in the checkpoint whatever the precision-aware optimizer keeps: it loads into any setting.
            out[param] = (lo, hi, {k: self._local_state(main, k).detach().reshape(-1).float() for k in keys})
        return out

    def param_state_for_save(self, params=None):
        """Each param's full (TP-local) state, gathered across DP (collective over the DP groups): only
        ``params`` when given (the same on every DP rank), all params otherwise."""
        optimizer_state.init_state(self)
        keys = sorted({k for main in self.shard_ranges for k in self.optimizer.state[main] if k != "step"})
        if any(p.dtype != torch.float32 for p in self.param_to_buffer_bucket):
            keys.append("fp32_param")
        keys = _agree_on_keys(keys)
        wanted = set(self.param_to_buffer_bucket) if params is None else set(params)
        out = {param: {} for param in self.param_to_buffer_bucket if param in wanted}
        for bucket, params_of_bucket in self._bucket_params().items():
            params_of_bucket = [p for p in params_of_bucket if p in wanted]
            if not params_of_bucket:
                continue
            for key in keys:
                full = self._gather_bucket_state(bucket, key)  # [bucket numel], fp32
                for param in params_of_bucket:
                    _, _, start, end = self.param_to_buffer_bucket[param]
                    out[param][key] = full[start - bucket.offset:end - bucket.offset].view(param.shape).clone()
        return out

    def _bucket_params(self):
        buckets = {}
        for param, (_, bucket, _, _) in self.param_to_buffer_bucket.items():
            buckets.setdefault(bucket, []).append(param)
        return buckets

    def _local_state(self, main, key):
        return main.detach() if key == "fp32_param" else self.optimizer.state[main][key]

    def _gather_bucket_state(self, bucket, key):
        shard_lo, shard_hi = bucket.shard_range()
        local = torch.zeros(shard_hi - shard_lo, dtype=torch.float32, device=bucket.grad_data.device)
        for main, (param, lo, hi) in self.shard_ranges.items():
            _, b, start, _ = self.param_to_buffer_bucket[param]
            if b is bucket:
                begin = start + lo - bucket.offset - shard_lo
                local[begin:begin + hi - lo].copy_(self._local_state(main, key).view(-1))
        full = torch.empty(bucket.grad_data.numel(), dtype=torch.float32, device=local.device)
        _all_gather_single(full, local, group=bucket.group)
        return full

    def set_param_state_from_load(self, model_param_state):
        optimizer_state.init_state(self)
        for main, (param, lo, hi) in self.shard_ranges.items():
            for key, value in model_param_state.get(param, {}).items():
                # The whole param's state, or (local_param_state's pieces loaded back) this rank's range only.
                flat = value.reshape(-1)
                piece = (flat[lo:hi] if flat.numel() == param.numel() else flat).view_as(main).to(main.device)
                if key == "fp32_param":
                    main.detach().copy_(piece)
                elif key in self.optimizer.state[main]:
                    self.optimizer.state[main][key].copy_(piece)
        self._copy_main_params_to_model_params()
        if self._owns_all_buffers:
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)
        else:
            self._start_own_param_sync(force_sync=True)


def _check_group(buffer, data_parallel_group):
    if data_parallel_group is None:
        return
    ranks = dist.get_process_group_ranks
    if ranks(buffer.data_parallel_group) != ranks(data_parallel_group):
        raise ValueError("DistributedOptimizer: data_parallel_group is not the DP group of the given buffers "
                         "(expert buffers use the expert-DP group; pass them to their own optimizer)")


def _agree_on_keys(keys):
    """Every DP rank must gather the same state keys, even a rank whose shard is empty."""
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, keys)
    return sorted(set().union(*[set(o) for o in objs]))
