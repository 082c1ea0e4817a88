"""Megatron Core's ``model_parallel_config.resolve_tensor_parallel_weight_shards``: weight rematerialisation
is not implemented here, so nothing calls it. Reached from ``megatron.core.model_parallel_config`` through
its lazy alias table.
"""
from typing import Optional


def resolve_tensor_parallel_weight_shards(tensor_model_parallel_size: int,
                                          tensor_parallel_num_weight_shards: Optional[int], gtp_weight_remat_size: int,
                                          shards_field: str = "tensor_parallel_num_weight_shards",
                                          tp_field: str = "tensor_model_parallel_size") -> tuple:
    """Megatron's (total weight shards, weight-rematerialisation size) pair made consistent: the shard
    count (a multiple of TP) decides remat = shards // TP; without it, shards = TP x remat. Weight
    rematerialisation itself is not implemented here (its config fields accept only their defaults, for
    which this returns (TP, 1))."""
    tp = tensor_model_parallel_size
    if tensor_parallel_num_weight_shards is None:
        return tp * gtp_weight_remat_size, gtp_weight_remat_size
    if tensor_parallel_num_weight_shards < tp or tensor_parallel_num_weight_shards % tp:
        raise ValueError(f"{shards_field} ({tensor_parallel_num_weight_shards}) must be a multiple of "
                         f"{tp_field} ({tp})")
    return tensor_parallel_num_weight_shards, tensor_parallel_num_weight_shards // tp
