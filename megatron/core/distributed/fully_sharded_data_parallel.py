"""Megatron-FSDP's entry point, `FullyShardedDataParallel`, on this repository's data-parallel engines (the
same mapping as --use-megatron-fsdp, docs/migrating.md): each sharding strategy runs on the engine that
shards the same state."""
import dataclasses

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.process_groups_config import require_default_process_groups

_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class FullyShardedDataParallel:
    """Megatron's constructor; `ddp_config.data_parallel_sharding_strategy` picks the engine, and the
    engine is what the call returns (not an instance of this class):

    - ``no_shard``: DistributedDataParallel;
    - ``optim`` (ZeRO-1): DistributedDataParallel with distributed-optimizer buffers;
    - ``optim_grads`` (ZeRO-2) / ``optim_grads_params`` (ZeRO-3): torch FSDP2 (TorchFullyShardedDataParallel)
      keeping the gathered params until backward / resharding them after forward, with `fsdp_unit_modules`
      as the units that are sharded on their own (default: the transformer layers).

    Build the optimizer with get_megatron_optimizer as usual: the strategy decides whether it is the
    distributed one (``optim``), whatever OptimizerConfig.use_distributed_optimizer says. `device` moves the module
    there first; `disable_bucketing` reaches DDP (one bucket per buffer)."""

    def __new__(cls, config, ddp_config, module, fsdp_unit_modules=None, disable_bucketing=False, device=None,
                pg_collection=None):
        strategy = ddp_config.data_parallel_sharding_strategy
        if strategy not in _STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy {strategy!r}: use one of {', '.join(_STRATEGIES)}")
        if strategy not in ("no_shard", "optim"):  # DDP takes explicit groups; the FSDP2 engine reads parallel_state's
            require_default_process_groups(pg_collection, f"FullyShardedDataParallel({strategy})")
        if device is not None:
            module = module.to(device)
        if strategy in ("no_shard", "optim"):
            ddp_config = dataclasses.replace(ddp_config, use_distributed_optimizer=strategy == "optim")
            engine = DistributedDataParallel(config, ddp_config, module, disable_bucketing=disable_bucketing,
                                             pg_collection=pg_collection)
        else:
            ddp_config = dataclasses.replace(ddp_config, use_distributed_optimizer=False, overlap_grad_reduce=False,
                                             overlap_param_gather=False)  # FSDP2 overlaps its own communication
            engine = TorchFullyShardedDataParallel(config, ddp_config, module, sub_modules_to_wrap=fsdp_unit_modules,
                                                   reshard_after_forward=strategy == "optim_grads_params")
        engine.data_parallel_sharding_strategy = strategy  # get_megatron_optimizer follows it
        return engine
