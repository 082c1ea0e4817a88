"""Contiguous param/grad buffers split into buckets, and each bucket's DP collectives.

All params of one (param dtype, grad dtype) pair live in one flat grad buffer (and, with the
distributed optimizer, one flat param buffer); `param.main_grad` is a view into it. The buffer is cut
into buckets (in reverse parameter order, roughly the order backward produces grads) that are reduced
with one collective each: all-reduce, or reduce-scatter when the distributed optimizer owns 1/DP of
every bucket. With the distributed optimizer the updated params come back with one all-gather per bucket.
With N distributed-optimizer instances the shards are 1/(DP/N) of a bucket: the reduce-scatter runs within an
instance and an all-reduce of the shard across instances completes the sum.
"""
import math
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import lazy_names

# Megatron's buffer-kind enum, which the buffers here do not use, resolved on first use.
__getattr__ = lazy_names(__name__, {"BufferType": "megatron.core._compat.param_and_grad_buffer"})

# The *_single names are newer than torch 2.4; the *_tensor collectives are the same operation.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class _ParamAndGradBucket:
    """A contiguous slice of a buffer holding `params`; owns that slice's DP collectives."""

    def __init__(self, params, param_data, grad_data, offset, numel_unpadded, bucket_id,
                 data_parallel_group, ddp_config, gradient_scaling_factor, param_to_name, inter_group=None):
        self.params = params
        self.param_data = param_data  # flat view (distributed optimizer only), else None
        self.grad_data = grad_data  # flat view
        self.offset = offset  # start of this bucket in the buffer
        self.numel_unpadded = numel_unpadded
        self.bucket_id = bucket_id
        self.group = data_parallel_group
        # --num-distributed-optimizer-instances > 1: the ranks of the other instances holding this rank's shard,
        # over which the reduce-scattered shard is all-reduced (None: one instance)
        self.inter_group = inter_group
        self.ddp_config = ddp_config
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_to_name = param_to_name
        self.dp_size = dist.get_world_size(group=data_parallel_group)
        self.dp_rank = dist.get_rank(group=data_parallel_group)
        self.grad_reduce_handle = None
        self.param_gather_handle = None
        self._gather_input = None
        self._reduce_output = None
        self._nan_messages = None  # (rejection function, message) of check_for_nan

    # -- shards (distributed optimizer) --------------------------------------------------------
    def shard_range(self, rank=None):
        """[start, end) of DP rank `rank`'s shard, relative to the bucket start."""
        rank = self.dp_rank if rank is None else rank
        shard = self.grad_data.numel() // self.dp_size
        return rank * shard, (rank + 1) * shard

    def local_grad_shard(self):
        start, end = self.shard_range()
        return self.grad_data[start:end]

    def local_param_shard(self):
        start, end = self.shard_range()
        return self.param_data[start:end]

    # -- gradient reduction --------------------------------------------------------------------
    def check_for_nan(self):
        """This rank's gradients of the bucket must be finite before they are reduced (Megatron's check, so
        a bad rank names itself). Judged by the rerun state machine: inside a training step's loop the
        verdict stays on the device until the step's pass ends (no host synchronisation per bucket); a
        capture records no check (the replayed graph's losses are checked instead)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        norm = torch.linalg.vector_norm(self.grad_data, dtype=torch.float32)  # no fp32 copy of 16-bit grads
        if self._nan_messages is None:  # built once: the check runs every step
            names = ", ".join(self.param_to_name.get(p, "?") for p in self.params)
            self._nan_messages = [(reject, f"found {what} in local grad norm for bucket #{self.bucket_id} in "
                                   f"backward pass before data-parallel communication collective (params: {names})")
                                  for what, reject in (("NaN", torch.isnan), ("Inf", torch.isinf))]
        rsm = get_rerun_state_machine()
        for reject, message in self._nan_messages:
            rsm.validate_result(norm, reject, message, tolerance=0.001, fatal=True)

    def start_grad_sync(self):
        """Launch this bucket's reduction (async when overlapping the grad reduce)."""
        assert self.grad_reduce_handle is None, "grad sync already started for this bucket"
        if self.ddp_config.check_for_nan_in_grad:
            self.check_for_nan()
        if self.dp_size == 1 and self.inter_group is None:
            # One replica: nothing to exchange (and no collective inside a captured CUDA graph).
            if self.gradient_scaling_factor != 1.0:
                self.grad_data.mul_(self.gradient_scaling_factor)
            self.grad_reduce_handle = _DoneHandle()
            return
        op = dist.ReduceOp.SUM
        if self.ddp_config.average_in_collective:
            op = dist.ReduceOp.AVG
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        async_op = self.ddp_config.overlap_grad_reduce
        if self.ddp_config.use_distributed_optimizer:
            shard = self.local_grad_shard()
            # NCCL reduces in place into this rank's shard; gloo gets a separate output, copied back.
            self._reduce_output = torch.empty_like(shard) if _is_gloo(self.group) else shard
            if self.inter_group is not None:
                handle = self._reduce_over_instances(op, async_op)
            else:
                handle = _reduce_scatter_single(self._reduce_output, self.grad_data, op=op,
                                                group=self.group, async_op=async_op)
        else:
            handle = dist.all_reduce(self.grad_data, op=op, group=self.group, async_op=async_op)
        self.grad_reduce_handle = handle if async_op else _DoneHandle()

    def _reduce_over_instances(self, op, async_op: bool):
        """The reduce-scatter within this instance's part of the DP group, then the all-reduce of the reduced
        shard over the instances. The all-reduce must follow the reduce-scatter's result, and a wait on it in the
        compute stream would stall the backward, so on CUDA both run in order on a side stream that first waits
        for the grads; the all-reduce's handle is what `finish_grad_sync` waits on."""
        if not self.grad_data.is_cuda:
            _reduce_scatter_single(self._reduce_output, self.grad_data, op=op, group=self.group)
            return dist.all_reduce(self._reduce_output, op=op, group=self.inter_group, async_op=async_op)
        side = _instance_stream(self.grad_data.device)
        side.wait_stream(torch.cuda.current_stream(self.grad_data.device))
        with torch.cuda.stream(side):
            _reduce_scatter_single(self._reduce_output, self.grad_data, op=op, group=self.group)
            handle = dist.all_reduce(self._reduce_output, op=op, group=self.inter_group, async_op=True)
        if not async_op:
            handle.wait()
        return handle

    def finish_grad_sync(self):
        """Wait for the reduction (starting it now if the hooks never did, e.g. unused params)."""
        if self.grad_reduce_handle is None:
            self.start_grad_sync()
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None
        if self._reduce_output is not None:
            shard = self.local_grad_shard()
            if self._reduce_output is not shard:
                shard.copy_(self._reduce_output)
            self._reduce_output = None

    # -- parameter all-gather (distributed optimizer) -------------------------------------------
    def start_param_sync(self, async_op: bool):
        assert self.param_gather_handle is None, "param all-gather already in flight"
        shard = self.local_param_shard()
        # NCCL gathers in place (input aliases this rank's slice of the output); gloo gets a copy.
        self._gather_input = shard.clone() if _is_gloo(self.group) else shard
        handle = _all_gather_single(self.param_data, self._gather_input, group=self.group,
                                        async_op=async_op)
        self.param_gather_handle = handle if async_op else _DoneHandle()

    def finish_param_sync(self):
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            self._gather_input = None


_INSTANCE_STREAMS = {}


def _instance_stream(device) -> "torch.cuda.Stream":
    """The side stream (one per device) on which a bucket's two-step reduction over instances runs."""
    if device not in _INSTANCE_STREAMS:
        _INSTANCE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _INSTANCE_STREAMS[device]


class _DoneHandle:
    def wait(self):
        return None


class _ParamAndGradBuffer:
    """One flat grad buffer (and param buffer with the distributed optimizer) for params of one dtype."""

    def __init__(self, ddp_config, param_dtype, grad_dtype, params: List[torch.nn.Parameter],
                 data_parallel_group, bucket_size: Optional[int], param_to_name: Dict,
                 gradient_scaling_factor: float, layer_wise: bool = False, inter_group=None):
        """``layer_wise`` (with the distributed optimizer): every param lies whole inside one DP rank's shard
        of its bucket, so that rank's reduce-scatter output holds its whole gradient (layer-wise Muon).
        ``inter_group``: with several distributed-optimizer instances, ``data_parallel_group`` is this instance's
        part of the DP group and the reduced shards are all-reduced over ``inter_group``."""
        self.ddp_config = ddp_config
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.params = list(params)
        self.data_parallel_group = data_parallel_group
        self.dp_size = dist.get_world_size(group=data_parallel_group)
        device = self.params[0].device
        if layer_wise and ddp_config.use_distributed_optimizer:
            self.param_index_map, bucket_spans, bucket_params, self.numel = _layer_wise_layout(
                self.params, self.dp_size, bucket_size)
        else:
            self.param_index_map, bucket_spans, bucket_params, self.numel = _default_layout(
                self.params, ddp_config, self.dp_size, bucket_size)

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        for param, (start, end, _) in self.param_index_map.items():
            if self.param_data is not None:
                # Params become views into the flat buffer so that one all-gather refreshes a bucket.
                view = self.param_data[start:end].view(param.shape)
                view.copy_(param.data)
                param.data = view
            param.main_grad = self.grad_data[start:end].view(param.shape)

        self.buckets = []
        for bucket_id, ((start, end_unpadded, end), params_) in enumerate(zip(bucket_spans, bucket_params)):
            self.buckets.append(_ParamAndGradBucket(
                params_, None if self.param_data is None else self.param_data[start:end],
                self.grad_data[start:end], start, end_unpadded - start, bucket_id,
                data_parallel_group, ddp_config, gradient_scaling_factor, param_to_name, inter_group))
        self.param_to_bucket = {p: self.buckets[b] for p, (_, _, b) in self.param_index_map.items()}

    def scale_gradients(self, scaling_factor: float):
        self.grad_data.mul_(scaling_factor)

    def reset(self):
        """Zero the grad buffer (start of an iteration)."""
        self.grad_data.zero_()


def _default_layout(params, ddp_config, dp_size, bucket_size):
    """(param -> (start, end, bucket id), bucket spans (start, unpadded end, padded end), bucket params,
    numel): params in reverse order; a bucket closes once it holds >= bucket_size elements."""
    pad = dp_size * 64 if ddp_config.use_distributed_optimizer else 1
    # With the distributed optimizer a tied embedding gets a bucket of its own: its grad is summed
    # over the first and last pipeline stage after the reduce-scatter, which is only right when both
    # stages shard it identically (as Megatron does).
    param_index_map = {}
    bucket_spans, bucket_params, cursor, bucket_start = [], [[]], 0, 0

    def close_bucket():
        nonlocal cursor, bucket_start
        padded_end = bucket_start + math.ceil((cursor - bucket_start) / pad) * pad
        bucket_spans.append((bucket_start, cursor, padded_end))
        cursor = bucket_start = padded_end
        bucket_params.append([])

    for param in params[::-1]:
        alone = ddp_config.use_distributed_optimizer and getattr(param, "shared_embedding", False)
        if alone and bucket_params[-1]:
            close_bucket()
        param_index_map[param] = (cursor, cursor + param.numel(), len(bucket_spans))
        cursor += param.numel()
        bucket_params[-1].append(param)
        if alone or (bucket_size is not None and cursor - bucket_start >= bucket_size):
            close_bucket()
    if bucket_params[-1]:
        close_bucket()
    bucket_params.pop()  # the empty list opened by the last close
    return param_index_map, bucket_spans, bucket_params, cursor


def _layer_wise_layout(params, dp_size, bucket_size):
    """`_default_layout`'s result for the layer-wise distributed optimizer: params (reverse order) are cut
    into buckets of >= max(bucket_size, DP x largest param) elements, then each bucket's params are
    bin-packed whole into its DP shards (largest first onto the least-loaded shard; ties to the lower rank,
    so every rank computes the same assignment) and the shards padded to one size, a multiple of 64."""
    chunks, chunk, numel, largest = [], [], 0, 0
    for param in params[::-1]:
        chunk.append(param)
        numel, largest = numel + param.numel(), max(largest, param.numel())
        # A bucket also holds at least DP x its largest param, so that every shard gets work.
        if bucket_size is not None and numel >= max(bucket_size, dp_size * largest):
            chunks.append(chunk)
            chunk, numel, largest = [], 0, 0
    if chunk:
        chunks.append(chunk)
    param_index_map, bucket_spans, cursor = {}, [], 0
    for bucket_id, members in enumerate(chunks):
        loads, shards = [0] * dp_size, [[] for _ in range(dp_size)]
        for param in sorted(members, key=lambda p: -p.numel()):  # stable: equal sizes keep bucket order
            rank = min(range(dp_size), key=lambda r: loads[r])
            shards[rank].append(param)
            loads[rank] += param.numel()
        shard_size = max(64, math.ceil(max(loads) / 64) * 64)
        for rank, shard in enumerate(shards):
            start = cursor + rank * shard_size
            for param in shard:
                param_index_map[param] = (start, start + param.numel(), bucket_id)
                start += param.numel()
        end = cursor + dp_size * shard_size
        bucket_spans.append((cursor, end, end))
        cursor = end
    return param_index_map, bucket_spans, chunks, cursor


class _ParamAndGradBucketGroup:
    """Buckets whose collectives launch together: once every param of every bucket in the group has its
    grad (with overlap_grad_reduce), or at finish_grad_sync. DDP drives its buckets through groups."""

    def __init__(self, buckets: List[_ParamAndGradBucket], ddp_config, collective_group,
                 collective_group_size: int):
        self.buckets = list(buckets)
        self.ddp_config = ddp_config
        self.data_parallel_group = collective_group
        self.data_parallel_world_size = collective_group_size
        self.params = {p for bucket in self.buckets for p in bucket.params}
        self.params_with_grad = set()
        self.is_last_microbatch = True
        self.ready_on = {}  # CUDA stream -> event after the latest grad reported ready on it

    def reset(self):
        self.params_with_grad = set()
        self.is_last_microbatch = True
        self.ready_on = {}

    def start_grad_sync(self):
        # The collective follows the stream that launches it; grads reported ready on another stream (autograd
        # accumulates a leaf's grad on its AccumulateGrad node's stream, a deferred weight gradient lands on
        # the backward's, and the overlapped MoE schedule keeps the nodes on a stream of their own) are waited
        # for first, so the reduction never reads a grad still being added.
        if self.ready_on:
            current = torch.cuda.current_stream()
            for stream, event in self.ready_on.items():
                if stream != current:
                    current.wait_event(event)
            self.ready_on = {}
        for bucket in self.buckets:
            if bucket.grad_reduce_handle is None:
                bucket.start_grad_sync()

    def finish_grad_sync(self):
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def register_grad_ready(self, param):
        """Called by the backward hook; launches the group's collectives when its last grad is in."""
        assert self.ddp_config.overlap_grad_reduce
        if not self.is_last_microbatch:
            return
        assert param in self.params, "param is not in this bucket group"
        if param in self.params_with_grad:
            name = next((b.param_to_name[param] for b in self.buckets if param in b.param_to_name), "?")
            raise AssertionError(f"param {name}'s grad reported ready twice in one backward")
        self.params_with_grad.add(param)
        if param.is_cuda:
            stream = torch.cuda.current_stream(param.device)
            event = self.ready_on.get(stream)
            if event is None:
                event = self.ready_on[stream] = torch.cuda.Event()
            event.record(stream)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_param_sync(self, force_sync: bool = False):
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        for bucket in self.buckets:
            bucket.finish_param_sync()
            bucket.start_param_sync(async_op=async_op)
        if not async_op:
            self.finish_param_sync()

    def finish_param_sync(self):
        for bucket in self.buckets:
            bucket.finish_param_sync()


def partition_buckets(buffers: List[_ParamAndGradBuffer], force_single_bucket_group: bool = False,
                      reduce_scatter_with_fp32_accumulation: bool = False) -> List[_ParamAndGradBucketGroup]:
    """Group the buckets of ``buffers`` for communication: one group per bucket, or, with
    ``force_single_bucket_group`` (DDP's disable_bucketing), every bucket of every buffer in one group
    (the buffers must share the DDP config and group). Megatron's third case (FP8 parameter buffers,
    whose non-FP8 buckets join the last FP8 group) does not arise: parameters are never stored in FP8."""
    if reduce_scatter_with_fp32_accumulation:
        raise NotImplementedError("partition_buckets(reduce_scatter_with_fp32_accumulation=True) is not "
                                  "supported; use grad_reduce_in_fp32 for fp32 reductions")
    if not buffers:
        return []
    if any(buffer.param_dtype == torch.uint8 for buffer in buffers):
        raise NotImplementedError("partition_buckets: FP8 (uint8) parameter buffers do not exist here")
    first = buffers[0]
    if force_single_bucket_group:
        for buffer in buffers[1:]:
            if buffer.ddp_config != first.ddp_config or buffer.data_parallel_group != first.data_parallel_group:
                raise ValueError("partition_buckets: buffers of one group must share the DDP config and group")
        return [_ParamAndGradBucketGroup([b for buffer in buffers for b in buffer.buckets], first.ddp_config,
                                         first.data_parallel_group, first.dp_size)]
    return [_ParamAndGradBucketGroup([bucket], buffer.ddp_config, buffer.data_parallel_group, buffer.dp_size)
            for buffer in buffers for bucket in buffer.buckets]


class BufferKey(NamedTuple):
    """Which flat buffer a param goes to: one per distinct combination of these."""
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


def group_params_for_buffers(params: List[torch.nn.Parameter], grad_reduce_in_fp32: bool):
    """{BufferKey: (params, indices)}: params split by (dtype, grad dtype: fp32 with
    `grad_reduce_in_fp32`, expert or dense); each param's index counts the params before it with the
    same key. Params are trainable (requires_grad)."""
    out = {}
    for param in params:
        if not param.requires_grad:
            raise ValueError("group_params_for_buffers: got a param that does not require grad")
        key = BufferKey(param.dtype, torch.float32 if grad_reduce_in_fp32 else param.dtype,
                        not getattr(param, "allreduce", True),
                        bool(getattr(param, "is_managed_by_layer_wise_optimizer", False)))
        group, indices = out.setdefault(key, ([], []))
        indices.append(len(group))
        group.append(param)
    return out


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> List[torch.Tensor]:
    """Views of the DP ranks' equal, contiguous shards of a flat buffer (its size is a multiple of DP)."""
    if buffer.numel() % data_parallel_world_size:
        raise ValueError(f"shard_buffer: {buffer.numel()} elements do not split into {data_parallel_world_size} "
                         "equal shards")
    size = buffer.numel() // data_parallel_world_size
    return [buffer[r * size:(r + 1) * size] for r in range(data_parallel_world_size)]
