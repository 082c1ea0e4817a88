"""ModelParallelConfig fields of Megatron Core 0.19.2 that have no counterpart here, with Megatron's defaults.

ModelParallelConfig inherits them so that code written for Megatron constructs it unchanged; its
__post_init__ refuses any of them set away from its default (check_compat_fields), except fields a
subclass declares itself: a feature that lands redefines its fields on the real config and so takes
them over. Generated from Megatron's source; keep the order of its dataclass.
"""
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, Callable, Optional


@dataclass
class ModelParallelConfigCompat:
    """ModelParallelConfig fields of Megatron Core 0.19.2 that have no counterpart here."""

    tensor_parallel_num_weight_shards: Optional[int] = None
    gtp_weight_remat_size: int = 1
    pipeline_model_parallel_comm_backend: Any = None
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    hybrid_context_parallel: bool = False
    expert_tensor_parallel_num_weight_shards: Optional[int] = None
    expert_gtp_weight_remat_size: int = 1
    moe_grad_scale_func: Optional[Callable] = None
    mtp_grad_scale_func: Optional[Callable] = None
    deterministic_mode: bool = False
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    use_te_rng_tracker: bool = False
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_split_ag: bool = True
    tp_comm_atomic_ag: bool = False
    tp_comm_split_rs: bool = True
    tp_comm_atomic_rs: bool = False
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: Any = 'native'
    tp_comm_overlap_disable_qkv: bool = False
    tp_comm_overlap_disable_fc1: bool = False
    tp_comm_bootstrap_backend: Any = 'nccl'
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    ep_overlap_early_attn_memory_release: bool = False
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    mtp_standalone: bool = False
    _cpu_offloading_context: Any = None
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False


def compat_only_fields(config, mixin):
    """Fields of `mixin` that no class between `config` (an instance or a class) and `mixin` declares."""
    declared = set()
    for cls in (config if isinstance(config, type) else type(config)).__mro__:
        if cls is not mixin and issubclass(cls, mixin):
            declared.update(cls.__dict__.get("__annotations__", {}))
    return [f for f in fields(mixin) if f.name not in declared]


def all_compat_only_fields(config_class):
    """Names of every compat-only field of a config class, over all its compat mixins."""
    mixins = [c for c in config_class.__mro__ if c.__name__.endswith("Compat") and is_dataclass(c)]
    return {f.name for m in mixins for f in compat_only_fields(config_class, m)}


def check_compat_fields(config, mixin, inert=lambda name: False):
    """One-line ValueError for the first compat-only field set away from Megatron's default.

    `inert(name)` marks fields that Megatron itself ignores in this configuration (e.g. moe_* of a
    dense model): any value gives the same result there and here, so they are accepted."""
    for f in compat_only_fields(config, mixin):
        if inert(f.name):
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        value = getattr(config, f.name)
        try:
            same = value is default or bool(value == default)
        except Exception:  # e.g. tensors: anything but the default object counts as set
            same = False
        if not same:
            raise ValueError(f"{type(config).__name__}.{f.name}={value!r}: this Megatron feature is not "
                             f"implemented here; leave it at its default ({default!r})")
