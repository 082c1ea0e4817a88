"""Data-parallel wrapper with contiguous grad buffers and bucketed, optionally overlapped reduction."""
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer, partition_buckets
from megatron.core.distributed.wrapped_module import WrappedModule
from megatron.core.fusions.grad_accumulation import accumulate_into_main_grad, claim_first_write
from megatron.core.process_groups_config import get_pg


def buckets_of(num_parameters: int, num_buckets: int) -> int:
    """The bucket size that splits ``num_parameters`` into about ``num_buckets`` buckets (--ddp-num-buckets)."""
    return max(1, num_parameters // num_buckets)


class DistributedDataParallel(WrappedModule):
    """Wraps `module`: every param gets `.main_grad` (a view into a flat per-dtype buffer); backward
    hooks accumulate `param.grad` into it and, with `overlap_grad_reduce`, launch each bucket group's
    collectives as soon as the group's last grad is in (one bucket per group; all buckets in one group
    with `disable_bucketing`). Grads end up averaged over the DP x CP group.

    ``pg_collection``: explicit groups, ``dp_cp`` for the dense grads and ``expt_dp`` for the expert grads
    (parallel_state's when None)."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False, pg_collection=None, full_param_layout=None):
        if full_param_layout is not None:
            raise NotImplementedError("DistributedDataParallel(full_param_layout=...) is not supported; "
                                      "buffers use the default layout")
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.pg_collection = pg_collection

        # The whole DP x CP group: the mean over the batch divides by its size, whatever the optimizer's shards.
        dp_size = dist.get_world_size(group=self._dp_group(expert=False))
        dp_group, inter_group = self._shard_groups(expert=False)
        bucket_size = ddp_config.bucket_size
        if bucket_size is None and ddp_config.num_buckets is not None:
            bucket_size = buckets_of(sum(p.numel() for p in module.parameters()), ddp_config.num_buckets)
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * dp_size)
        if not ddp_config.overlap_grad_reduce or disable_bucketing:
            bucket_size = None  # one bucket per buffer: the collective runs once, after backward
        self.bucket_size = bucket_size

        # Per-token loss: grads are summed over DP and divided later by the global token count.
        per_token = getattr(config, "calculate_per_token_loss", False)
        dense_scale = 1.0 if (per_token or ddp_config.average_in_collective) else 1.0 / dp_size

        param_to_name = {p: n for n, p in module.named_parameters()}
        dense, expert = [], []
        for param in module.parameters():
            if param.requires_grad:
                (dense if getattr(param, "allreduce", True) else expert).append(param)
        self.buffers = self._make_buffers(dense, dp_group, dense_scale, param_to_name, inter_group)
        self.expert_parallel_buffers = []
        if expert:
            edp_size = dist.get_world_size(group=self._dp_group(expert=True))
            edp_group, expert_inter_group = self._shard_groups(expert=True)
            # Expert grads are summed over the expert-DP group, whose ranks saw different tokens of
            # the same DP-sized batch (EP takes ranks out of DP, TP splits the tokens in MoE layers):
            # the mean over the batch is that sum / DP, as for dense grads.
            expert_scale = 1.0 if per_token else 1.0 / dp_size
            if ddp_config.average_in_collective and not per_token:
                expert_scale = edp_size / dp_size  # the collective already divides by edp_size
            self.expert_parallel_buffers = self._make_buffers(expert, edp_group, expert_scale, param_to_name,
                                                              expert_inter_group)

        self.param_to_bucket = {}
        for buffer in self.buffers + self.expert_parallel_buffers:
            self.param_to_bucket.update(buffer.param_to_bucket)
        self.bucket_groups = partition_buckets(self.buffers, force_single_bucket_group=disable_bucketing)
        self.expert_parallel_bucket_groups = partition_buckets(self.expert_parallel_buffers,
                                                               force_single_bucket_group=disable_bucketing)
        self.param_to_bucket_group = {p: group for group in self.bucket_groups + self.expert_parallel_bucket_groups
                                      for p in group.params}
        # The all-gathers after the optimizer step queue on one NCCL stream per group and complete in launch
        # order, while the buckets hold params in backward order (the first layers in the last bucket). Launched
        # in the forward's order, the first layers' params arrive first and the forward starts while the rest
        # still travel; in bucket order the first pre-hook would wait for every bucket.
        position = {p: i for i, p in enumerate(self.module.parameters())}
        self._param_gather_order = sorted(
            self.bucket_groups + self.expert_parallel_bucket_groups,
            key=lambda group: min(position.get(p, len(position)) for p in group.params))
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_hook)
                            for p in self.param_to_bucket]
        self._param_gather_hooks = {}
        if ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    def _dp_group(self, expert: bool):
        """The group a grad is reduced over: expert-DP for expert params, DP x CP for the others."""
        if self.pg_collection is None:
            return (parallel_state.get_expert_data_parallel_group() if expert
                    else parallel_state.get_data_parallel_group(with_context_parallel=True))
        return get_pg(self.pg_collection, "expt_dp" if expert else "dp_cp", "DistributedDataParallel")

    def _shard_groups(self, expert: bool):
        """(the group a bucket's reduce-scatter and all-gather run over, the group its reduced shard is then
        all-reduced over, or None). With --num-distributed-optimizer-instances N the distributed optimizer shards
        over 1/N of the DP group, and the N ranks holding the same shard sum it: the whole group's sum in two
        steps, the larger within a part (one node, say) and only a 1/part-size shard across parts."""
        instances = self.ddp_config.num_distributed_optimizer_instances
        if instances == 1:
            return self._dp_group(expert), None
        if self.pg_collection is None:
            if expert:
                intra = parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True)
            else:
                intra = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            inter = parallel_state.get_inter_distributed_optimizer_instance_group(expert=expert)
        else:
            if expert:
                raise NotImplementedError("DistributedDataParallel(pg_collection=...): expert parameters with "
                                          "--num-distributed-optimizer-instances > 1 take parallel_state's groups; "
                                          "pass pg_collection=None")
            intra = get_pg(self.pg_collection, "intra_dp_cp", "DistributedDataParallel")
            inter = get_pg(self.pg_collection, "inter_dist_opt", "DistributedDataParallel")
        if inter is None or dist.get_world_size(group=inter) != instances:
            raise ValueError(f"--num-distributed-optimizer-instances {instances}: the process groups were built for "
                             f"{1 if inter is None else dist.get_world_size(group=inter)} instance(s); pass the same "
                             "number to initialize_model_parallel")
        return intra, inter

    def _make_buffers(self, params, group, scaling, param_to_name, inter_group=None):
        """One buffer per (param dtype, grad dtype, layer-wise): params tagged
        `is_managed_by_layer_wise_optimizer` (Muon's, by the layer-wise optimizer's tagging) get buffers
        whose DP shards hold whole params; the others keep the default layout."""
        by_key = {}
        for param in params:
            grad_dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype
            layer_wise = bool(getattr(param, "is_managed_by_layer_wise_optimizer", False))
            by_key.setdefault((param.dtype, grad_dtype, layer_wise), []).append(param)
        return [_ParamAndGradBuffer(self.ddp_config, param_dtype, grad_dtype, ps, group, self.bucket_size,
                                    param_to_name, scaling, layer_wise=layer_wise, inter_group=inter_group)
                for (param_dtype, grad_dtype, layer_wise), ps in by_key.items()]

    def _all_buckets(self):
        for buffer in self.buffers + self.expert_parallel_buffers:
            yield from buffer.buckets

    def _grad_hook(self, param):
        """Move `param.grad` into `main_grad` (freeing it) and report the grad ready to its bucket."""
        if param.grad is None and getattr(param, "delay_wgrad", False):
            return  # --delay-wgrad-compute: the experts' store adds this grad later and calls this hook then
        if param.grad is not None:
            # A fused wgrad already went into main_grad (`.grad` is zeros), unless the param is also
            # used outside fused linears (`zero_out_wgrad`: tied embedding), whose grad is in `.grad`.
            if not getattr(param, "grad_added_to_main_grad", False) or getattr(param, "zero_out_wgrad", False):
                # The iteration's first gradient lands on zero_grad_buffer's zeros: written, not added.
                accumulate_into_main_grad(param.main_grad, param.grad.data, overwrite=claim_first_write(param))
            param.grad = None
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket_group[param].register_grad_ready(param)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    # -- gradient synchronization ----------------------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Accumulate grads locally (no collective) inside this context: all but the last microbatch."""
        for group in self._bucket_groups():
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self._bucket_groups():
                group.is_last_microbatch = True

    def _bucket_groups(self):
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def start_grad_sync(self, *unused):
        """Launch every bucket's collective that has not been launched yet."""
        for group in self._bucket_groups():
            group.start_grad_sync()

    def finish_grad_sync(self):
        """Complete the DP reduction of all grads (launching what overlap did not launch)."""
        for group in self._bucket_groups():
            group.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float):
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self):
        """Zero all main grads; call at the start of every iteration."""
        for param in self.param_to_bucket:
            param.grad_added_to_main_grad = False
            param.main_grad_fresh = True  # main_grad holds zeros until its first write (claim_first_write)
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.reset()
        for group in self._bucket_groups():
            group.reset()

    def broadcast_params(self):
        """Copy DP rank 0's params to the other DP ranks (identical start on every replica)."""
        for param in self.module.parameters():
            group = self._dp_group(expert=not getattr(param, "allreduce", True))
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    # -- parameter all-gather (distributed optimizer) -------------------------------------------
    def start_param_sync(self, *unused, force_sync: bool = False):
        """All-gather updated param shards, in the forward's order; async (waited on in forward pre-hooks) with
        overlap_param_gather."""
        for group in self._param_gather_order:
            group.start_param_sync(force_sync=force_sync)

    def finish_param_sync(self):
        for group in self._bucket_groups():
            group.finish_param_sync()

    def enable_forward_pre_hook(self):
        """Before each submodule runs, wait for the all-gathers of the buckets holding its params."""
        assert not self._param_gather_hooks, "forward pre-hooks already enabled"
        for module in self.module.modules():
            own = [p for p in module.parameters(recurse=False) if p in self.param_to_bucket]
            if own:
                self._param_gather_hooks[module] = module.register_forward_pre_hook(self._make_pre_hook(own))

    def disable_forward_pre_hook(self, param_sync: bool = True):
        for handle in self._param_gather_hooks.values():
            handle.remove()
        self._param_gather_hooks = {}
        if param_sync:
            self.finish_param_sync()

    def _make_pre_hook(self, params):
        buckets = {id(self.param_to_bucket[p]): self.param_to_bucket[p] for p in params}

        def hook(module, args):
            for bucket in buckets.values():
                bucket.finish_param_sync()
        return hook
