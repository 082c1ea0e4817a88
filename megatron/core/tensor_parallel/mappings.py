"""Communication ops as autograd functions, in conjugate pairs.

Each forward collective has its adjoint as backward:
copy (identity) <-> all-reduce, split <-> all-gather, SP all-gather <-> SP reduce-scatter.
Every public wrapper takes an optional ``group``; the default is the registry's TP group. With no
group (single process) or a group of one rank every op is the identity.
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

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


def _traced():
    """Inside a torch.compile'd region (--torch-compile's layers) the collectives take their functional
    form, which returns a new tensor: the in-place forms write into a buffer that the traced graph
    allocated, and torch 2.11's AOTAutograd dropped those writes in a traced backward on NCCL (the
    all-gather of the saved input and the reduce-scatter of dL/dX came back as the empty buffers, so every
    weight of the compiled TP=2 + SP layers got a zero gradient and only the residual path carried dL/dX).
    Eager runs keep the in-place forms (no extra output allocation)."""
    return torch.compiler.is_compiling()


def _reduce(x, group):
    """All-reduce (sum) over ``group``."""
    if _size(group) == 1:
        return x
    x = x.contiguous()
    if _traced():
        return funcol.all_reduce(x, "sum", group)
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
    if _traced():
        return funcol.all_gather_tensor(x, 0, group)
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
    if _traced():
        return funcol.reduce_scatter_tensor(x, "sum", 0, group)
    out = torch.empty((x.size(0) // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def _conjugate_pair(name, forward_op, backward_op, doc):
    """An autograd function: `forward_op(x, group)` forward, its adjoint `backward_op(grad, group)` backward."""
    def forward(ctx, x, group):
        ctx.group = group
        return forward_op(x, group)

    def backward(ctx, grad):
        return backward_op(grad, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)})


def _identity(x, group):
    return x


_CopyToModelParallelRegion = _conjugate_pair(
    "_CopyToModelParallelRegion", _identity, _reduce, "Identity forward; all-reduce of the gradient backward.")
_ReduceFromModelParallelRegion = _conjugate_pair(
    "_ReduceFromModelParallelRegion", _reduce, _identity, "All-reduce forward; identity backward.")
_ScatterToModelParallelRegion = _conjugate_pair(
    "_ScatterToModelParallelRegion", _split_along_last_dim, _gather_along_last_dim,
    "Keep this rank's chunk of the last dim; all-gather backward.")
_GatherFromModelParallelRegion = _conjugate_pair(
    "_GatherFromModelParallelRegion", _gather_along_last_dim, _split_along_last_dim,
    "All-gather along the last dim; split backward.")
_ScatterToSequenceParallelRegion = _conjugate_pair(
    "_ScatterToSequenceParallelRegion", _split_along_first_dim, _gather_along_first_dim,
    "Keep this rank's chunk of the sequence (first) dim; all-gather backward.")


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


_ReduceScatterToSequenceParallelRegion = _conjugate_pair(
    "_ReduceScatterToSequenceParallelRegion", _reduce_scatter_along_first_dim, _gather_along_first_dim,
    "Reduce-scatter along the sequence dim; all-gather backward.")


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
    if _traced():
        return funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)
    if output_split_sizes is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                           group=group)
    return out


def _reduce_scatter_along_last_dim(x, group):
    """Sum over ``group``, keep this rank's chunk of the last dim (reduce-scatter along dim 0 of the
    transposed tensor, the adjoint of _gather_along_last_dim)."""
    n = _size(group)
    if n == 1:
        return x
    if x.size(-1) % n != 0:
        raise ValueError(f"last dimension {x.size(-1)} is not divisible by the group size {n}")
    return _reduce_scatter_along_first_dim(x.movedim(-1, 0).contiguous(), group).movedim(0, -1).contiguous()


_AllGatherFromTensorParallelRegion = _conjugate_pair(
    "_AllGatherFromTensorParallelRegion", _gather_along_last_dim, _reduce_scatter_along_last_dim,
    "All-gather along the last dim; reduce-scatter along the last dim backward.")
_ReduceScatterToTensorParallelRegion = _conjugate_pair(
    "_ReduceScatterToTensorParallelRegion", _reduce_scatter_along_last_dim, _gather_along_last_dim,
    "Reduce-scatter along the last dim; all-gather along the last dim backward.")


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 with per-rank split sizes; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, group, x, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        return _all_to_all(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        return None, _all_to_all(grad, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes), None, None


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False):
    """Rank r sends rows [sum(input_split_sizes[:j]), +input_split_sizes[j]) to rank j (equal splits if None).
    `use_nccl_stream` (run the exchange on NCCL's own CUDA stream) has no effect here: the collective
    runs on the current stream."""
    if group is None:
        raise ValueError("all_to_all: pass the process group to exchange over (group=None)")
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """[..., h/tp] -> [..., h]: all-gather along the last dim; backward reduce-scatters the gradient."""
    return _AllGatherFromTensorParallelRegion.apply(input_, _tp_group(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """[..., h] partial sums -> [..., h/tp] summed chunk of this rank; backward all-gathers."""
    return _ReduceScatterToTensorParallelRegion.apply(input_, _tp_group(group))


def _tokens_2d(input_, group):
    """(TP group, its size, input as [tokens, hidden])."""
    group = _tp_group(group)
    return group, _size(group), input_.reshape(-1, input_.shape[-1])


def all_to_all_sp2hp(input_, group=None):
    """[num_tokens/tp, h] (split by sequence) -> [num_tokens, h/tp] (split by hidden), over the TP group."""
    group, n, x = _tokens_2d(input_, group)
    if n == 1:
        return x
    # Column chunk j goes to rank j; stacking the chunks along rows makes that a plain dim-0 all-to-all.
    return all_to_all(group, torch.cat(torch.split(x, x.shape[-1] // n, dim=1), dim=0))


def all_to_all_hp2sp(input_, group=None):
    """[num_tokens, h/tp] (split by hidden) -> [num_tokens/tp, h] (split by sequence); inverse of sp2hp."""
    group, n, x = _tokens_2d(input_, group)
    if n == 1:
        return x
    y = all_to_all(group, x)  # row block j now holds rank j's hidden chunk of this rank's tokens
    return torch.cat(torch.split(y, y.shape[0] // n, dim=0), dim=-1)
