"""Describe a model's parameters and persistent buffers as ShardedTensors under global names.

Dict keys are the local state-dict keys (so a loaded dict feeds ``model.load_state_dict``);
``ShardedTensor.key`` is the global TP=PP=1 name, so checkpoints reshard across layouts.
replica_id = (TP replica, PP replica, DP rank): exactly one rank has all zeros for each shard.
"""
import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer import te_key_map
from megatron.core.transformer.initialize import global_param_names, tp_rank_and_size
from megatron.core.utils import get_pg_rank, get_pg_size

# Tensors with a vocab dimension: the padded vocab is a multiple of make_vocab_size_divisible_by x TP, so its
# global size changes with TP. Loading reads the rows both layouts have; extra padding rows keep their values.
_VOCAB_PADDED_SUFFIXES = ("word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def _sharded_tensor(key: str, tensor: torch.Tensor, pp_replica: int, dp_rank: int) -> ShardedTensor:
    if getattr(tensor, "partition_sizes", None) is not None and getattr(tensor, "tensor_model_parallel", False):
        return _sectioned_factory(key, tensor, pp_replica, dp_rank)
    sharded = _layout_sharded_tensor(key, tensor, pp_replica, dp_rank)
    sharded.allow_shape_mismatch = key.endswith(_VOCAB_PADDED_SUFFIXES)
    return sharded


def _sectioned_factory(key: str, tensor: torch.Tensor, pp_replica: int, dp_rank: int) -> ShardedTensorFactory:
    """A TP-split tensor fusing parts of different sizes (``partition_sizes``, e.g. Mamba's in_proj [z, x, B,
    C, dt]) is saved as Megatron saves it: one ShardedTensor per part, ``<key>.<part name>``, each split over
    TP, so it reshards to any TP size; loading concatenates the parts again."""
    rank, size = tp_rank_and_size(tensor)
    dim = tensor.partition_dim
    names, sizes = tensor.partition_names, tensor.partition_sizes

    def build(k, data, replica_id, flattened_range):
        parts = torch.split(data.detach(), sizes, dim=dim)
        return [ShardedTensor.from_rank_offsets(f"{k}.{name}", part, (dim, rank, size), replica_id=replica_id)
                for name, part in zip(names, parts)]

    def merge(loaded):
        # A list, or {index: tensor} when the checkpoint's common state did not hold this list's shell.
        parts = [loaded[i] for i in sorted(loaded)] if isinstance(loaded, dict) else loaded
        return torch.cat(parts, dim=dim)

    return ShardedTensorFactory(key, tensor.detach(), build, merge, replica_id=(0, pp_replica, dp_rank))


def _layout_sharded_tensor(key: str, tensor: torch.Tensor, pp_replica: int, dp_rank: int) -> ShardedTensor:
    expert = not getattr(tensor, "allreduce", True)
    if expert:  # replicated over expert-DP, not DP; stacked experts are split over EP along expert_dim
        dp_rank = parallel_state.get_expert_data_parallel_rank()
    expert_dim = getattr(tensor, "expert_dim", None)
    offsets = []
    if expert_dim is not None:
        offsets.append((expert_dim, parallel_state.get_expert_model_parallel_rank(),
                        parallel_state.get_expert_model_parallel_world_size()))
    if not getattr(tensor, "tensor_model_parallel", False):
        tp_rank = tp_rank_and_size(tensor)[0]
        return ShardedTensor.from_rank_offsets(key, tensor.detach(), *offsets,
                                               replica_id=(tp_rank, pp_replica, dp_rank))
    rank, size = tp_rank_and_size(tensor)
    dim, stride = tensor.partition_dim, getattr(tensor, "partition_stride", 1)
    data = tensor.detach()
    if stride > 1:
        # [stride * n/tp, ...] -> [stride, n/tp, ...]: the global tensor is [stride, n, ...]
        shape = list(data.shape)
        data = data.reshape(shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:])
        dim += 1
    return ShardedTensor.from_rank_offsets(key, data, *offsets, (dim, rank, size),
                                           replica_id=(0, pp_replica, dp_rank))


def build_sharded_state_dict(model: torch.nn.Module, prefix: str = ""):
    names = global_param_names(model)
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    tied_output = getattr(model, "share_embeddings_and_output_weights", False)
    out = {}
    with te_key_map.local_names(model):
        state = model.state_dict(keep_vars=True)
    for local, tensor in state.items():
        if tensor is None:
            continue
        pp_replica = 0
        if tied_output and local == "output_layer.weight":
            if getattr(model, "pre_process", True):
                continue  # the embedding on this rank is the same tensor and is saved once
            pp_replica = 1  # a copy of the first stage's embedding: never written from here
        out[prefix + local] = _sharded_tensor(prefix + names[local], tensor, pp_replica, dp_rank)
    return te_key_map.rename_sharded(model, out, prefix)


def checkpoint_groups(kwargs):
    """Pop ``tp_group`` and ``dp_cp_group`` from ``kwargs``; both default to parallel_state's groups when
    neither is given (Megatron's sharded-tensor helpers take them as keyword arguments)."""
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    if tp_group is None and dp_cp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return tp_group, dp_cp_group


def make_tp_sharded_tensor_for_checkpoint(tensor, key, tp_axis=0, replica_id=None, prepend_offsets=(),
                                          **kwargs):
    """ShardedTensor of a tensor split along `tp_axis` over TP and replicated over DP."""
    tp_group, dp_cp_group = checkpoint_groups(kwargs)
    axis = tp_axis + len(prepend_offsets)
    if replica_id is None:
        replica_id = (0, 0, get_pg_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets,
                                           (axis, get_pg_rank(tp_group), get_pg_size(tp_group)),
                                           replica_id=replica_id, prepend_axis_num=len(prepend_offsets),
                                           **kwargs)
