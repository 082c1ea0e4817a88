"""`--use-torch-fsdp2`: torch's `fully_shard` over the DP group behind the DDP interface.

Params become DTensors sharded on dim 0 over DP; backward reduce-scatters (averaging over DP) into
sharded `.grad`s, so there is no `main_grad`: the optimizer works on `param.grad` and computes grad
statistics over the local shards summed across DP (see `MegatronOptimizer.get_grad_stats_parallel_group`).
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class TorchFullyShardedDataParallel(torch.nn.Module):
    def __init__(self, config, ddp_config, module: torch.nn.Module, sub_modules_to_wrap=None, **unused):
        super().__init__()
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if parallel_state.get_tensor_model_parallel_world_size() > 1 or \
                parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("--use-torch-fsdp2 with --tensor-model-parallel-size > 1 or "
                                      "--pipeline-model-parallel-size > 1 is not supported; use DDP "
                                      "(optionally --use-distributed-optimizer) for model parallelism")
        if ddp_config.use_distributed_optimizer:
            raise ValueError("--use-torch-fsdp2 already shards optimizer state; drop --use-distributed-optimizer")
        self.config, self.ddp_config, self.module = config, ddp_config, module
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        for param in module.parameters():  # identical start on every replica before sharding
            dist.broadcast(param.data, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        device_type = next(module.parameters()).device.type
        mesh = DeviceMesh.from_group(self.dp_group, device_type)
        # Shard each transformer layer (its own all-gather/reduce-scatter unit), then the root.
        wrap_types = tuple(sub_modules_to_wrap or ())
        for sub in module.modules():
            if wrap_types and isinstance(sub, wrap_types) and sub is not module:
                fully_shard(sub, mesh=mesh, reshard_after_forward=True)
        fully_shard(module, mesh=mesh, reshard_after_forward=True)

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

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
