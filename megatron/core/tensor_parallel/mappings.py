"""Communication ops as autograd functions, in conjugate pairs.

Each forward collective has its adjoint as backward:
copy (identity) <-> all-reduce, split <-> all-gather, SP all-gather <-> SP reduce-scatter.
Every public wrapper takes an optional ``group``; the default is the registry's TP group. With no
group (single process) or a group of one rank every op is the identity.
"""
import torch
import torch.distributed as dist

from megatron.core import parallel_state

# all_gather_into_tensor / reduce_scatter_tensor were renamed *_single in recent torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tp_group(group):
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _reduce(x, group):
    """All-reduce (sum) over ``group``."""
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_along_last_dim(x, group):
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[_rank(group)].contiguous()


def _gather_along_last_dim(x, group):
    n = _size(group)
    if n == 1:
        return x
    # Gather along dim 0 (contiguous per rank), then move the rank axis next to the last dim.
    out = _gather_along_first_dim(x.movedim(-1, 0).contiguous(), group)  # [n * h/n, ...]
    return out.movedim(0, -1).contiguous()


def _split_along_first_dim(x, group):
    n = _size(group)
    if n == 1:
        return x
    if x.size(0) % n != 0:
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {n}; "
                         "pick --seq-length divisible by --tensor-model-parallel-size with --sequence-parallel")
    return x.chunk(n, dim=0)[_rank(group)].contiguous()


def _gather_along_first_dim(x, group):
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_along_first_dim(x, group):
    n = _size(group)
    if n == 1:
        return x
    if x.size(0) % n != 0:
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {n}")
    x = x.contiguous()
    out = torch.empty((x.size(0) // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dim; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dim; split backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk of the sequence (first) dim; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence dim. Backward reduce-scatters when the consumer is TP-parallel (each rank
    holds a partial gradient of the full sequence), else just splits."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.tp_output_grad = group, tensor_parallel_output_grad
        return _gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_output_grad:
            return _reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return _split_along_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence dim; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


def _even_split_only(name, split_sizes):
    """Uneven sequence splits (Megatron's MoE token paths) are not implemented; `use_global_buffer`
    (reuse of a preallocated all-gather buffer) has no effect here."""
    if split_sizes is not None:
        raise NotImplementedError(f"{name}: uneven split sizes are not supported; split evenly")


def copy_to_tensor_model_parallel_region(input_, group=None):
    return _CopyToModelParallelRegion.apply(input_, _tp_group(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    return _ReduceFromModelParallelRegion.apply(input_, _tp_group(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    return _ScatterToModelParallelRegion.apply(input_, _tp_group(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    return _GatherFromModelParallelRegion.apply(input_, _tp_group(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    return _ScatterToSequenceParallelRegion.apply(input_, _tp_group(group))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                         output_split_sizes=None, use_global_buffer=False):
    _even_split_only("gather_from_sequence_parallel_region", output_split_sizes)
    return _GatherFromSequenceParallelRegion.apply(input_, _tp_group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                               use_global_buffer=False):
    _even_split_only("reduce_scatter_to_sequence_parallel_region", input_split_sizes)
    return _ReduceScatterToSequenceParallelRegion.apply(input_, _tp_group(group))


def _all_to_all(x, group, output_split_sizes, input_split_sizes):
    if _size(group) == 1:
        return x
    x = x.contiguous()
    if output_split_sizes is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                           group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 with per-rank split sizes; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, group, x, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        return _all_to_all(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        return None, _all_to_all(grad, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes), None, None


def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
    """Rank r sends rows [sum(input_split_sizes[:j]), +input_split_sizes[j]) to rank j (equal splits if None)."""
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)
