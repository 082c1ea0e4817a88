"""`--use-torch-fsdp2`: torch's `fully_shard` over the DP group behind the DDP interface.

Tensor parallelism is manual (each param is this rank's local TP shard), so FSDP2 runs on the DP
sub-mesh only: every local TP shard becomes a DTensor split on dim 0 over the DP ranks of its TP
rank. Backward reduce-scatters over DP into sharded `.grad`s, so there is no `main_grad`: the
optimizer works on `param.grad`, and grad statistics sum local shards over DP and model parallel
(`MegatronOptimizer.get_grad_stats_parallel_group`). TP reductions (sequence-parallel norm grads)
stay in `finalize_model_grads`, on the local shards, which line up across TP ranks.

`state_dict()` / `load_state_dict()` of the wrapped model speak whole local-TP tensors (as under
DDP; gathered over DP on save, so they are collectives over DP), which keeps `sharded_state_dict`
and checkpoints identical to a run without FSDP2.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron.core import parallel_state
from megatron.core.distributed.torch_fsdp2_state import full_local_tensor, is_dtensor, megatron_attributes, shard_like
from megatron.core.distributed.wrapped_module import WrappedModule
from megatron.core.transformer.transformer_layer import TransformerLayer


def _innermost(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _default_wrap_types():
    return (TransformerLayer,)


class TorchFullyShardedDataParallel(WrappedModule):
    def __init__(self, config, ddp_config, module: torch.nn.Module, sub_modules_to_wrap=None,
                 reshard_after_forward: bool = True, **unused):
        super().__init__()
        from torch.distributed.fsdp import fully_shard  # lazy: ~0.9 s to import (DTensor), only with --use-torch-fsdp2

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("--use-torch-fsdp2 with --pipeline-model-parallel-size > 1 is not "
                                      "supported; use DDP (optionally --use-distributed-optimizer) with PP")
        if ddp_config.use_distributed_optimizer:
            raise ValueError("--use-torch-fsdp2 already shards optimizer state; drop --use-distributed-optimizer")
        self.config, self.ddp_config, self.module = config, ddp_config, module
        # A TorchFullyShardedDataParallelConfig carries the setting itself (Megatron's interface).
        reshard_after_forward = getattr(ddp_config, "reshard_after_forward", reshard_after_forward)
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        for param in module.parameters():  # identical start on every replica before sharding
            dist.broadcast(param.data, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        attributes = {name: megatron_attributes(p) for name, p in module.named_parameters()}
        device_type = next(module.parameters()).device.type
        mesh = DeviceMesh.from_group(self.dp_group, device_type)
        # Shard each transformer layer (its own all-gather/reduce-scatter unit), then the root. Without
        # resharding after forward a layer's gathered params stay until its backward (ZeRO-2 traffic).
        wrap_types = tuple(sub_modules_to_wrap) if sub_modules_to_wrap is not None else _default_wrap_types()
        for sub in module.modules():
            if wrap_types and isinstance(sub, wrap_types) and sub is not module:
                fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        if getattr(config, "calculate_per_token_loss", False):
            module.set_gradient_divide_factor(1.0)  # sum over DP; finalize_model_grads divides by tokens
        # fully_shard replaced every param by a DTensor: give them back their partition metadata.
        for name, param in module.named_parameters():
            for key, value in attributes.get(name, {}).items():
                setattr(param, key, value)
        inner = _innermost(module)
        inner.register_state_dict_post_hook(_gather_state_dict_hook)
        inner.register_load_state_dict_pre_hook(_shard_state_dict_hook)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate unsharded grads locally; the last microbatch's backward reduce-scatters."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self, *unused):
        pass

    def finish_grad_sync(self):
        """FSDP2 reduce-scatters during backward; nothing is pending here."""

    def scale_gradients(self, scaling_factor: float):
        if torch.is_tensor(scaling_factor):  # sharded grads (DTensors) take a Python number
            scaling_factor = float(scaling_factor)
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)

    def zero_grad_buffer(self):
        for param in self.module.parameters():
            param.grad = None

    def broadcast_params(self):
        """Params are sharded from the start (rank 0's values were broadcast before sharding)."""

    def start_param_sync(self, *unused, force_sync: bool = False):
        pass

    def finish_param_sync(self):
        pass


def _gather_state_dict_hook(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: DTensor params -> whole local-TP tensors with their Megatron metadata."""
    params = dict(module.named_parameters(prefix=prefix.rstrip(".")) if prefix else module.named_parameters())
    for key, value in list(state_dict.items()):
        if is_dtensor(value):
            state_dict[key] = full_local_tensor(value, source=params.get(key, value))


def _shard_state_dict_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs):
    """load_state_dict pre-hook: whole local-TP tensors -> this rank's DTensor shard of each param."""
    params = dict(module.named_parameters(prefix=prefix.rstrip(".")) if prefix else module.named_parameters())
    for key, value in list(state_dict.items()):
        target = params.get(key)
        if target is not None and is_dtensor(target):
            state_dict[key] = shard_like(value, target)
