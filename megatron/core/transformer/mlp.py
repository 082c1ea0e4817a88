"""Feed-forward block: fc1 (column-parallel) -> activation (GeLU / SwiGLU / squared-ReLU) -> fc2 (row-parallel)."""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.activations import glu, glu_extras
from megatron.core.fusions.fused_bias_activation import bias_swiglu, fused_bias_activation
from megatron.core.fusions.swiglu import swiglu, triton_swiglu_available
from megatron.core.fusions.weighted_squared_relu import uses_weighted_squared_relu, weighted_squared_relu
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_protocols import (  # noqa: F401  (Megatron's typing Protocols)
    LinearFc1Builder,
    LinearFc1Interface,
    LinearFc2Builder,
    LinearFc2Interface,
    TEActivationFunctionBuilder,
    TEActivationFunctionInterface,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None
    activation_func: Union[ModuleSpec, type] = None  # Megatron's TE activation module; refused by MLP


class MLP(MegatronModule):
    """h -> f -> h. With ``gated_linear_unit`` fc1 emits [gate; up] (2f) and the hidden is act(gate) * up.

    fc1's weight is marked ``partition_stride=2`` under GLU: the TP=1 tensor is [gate; up] and each
    rank holds [gate_r; up_r], the r-th slice of each half. ``tp_group`` splits fc1 and fc2 (None: the
    linears' default, parallel_state's TP group, or its expert-TP group with ``is_expert``).
    """

    def __init__(self, config, submodules: MLPSubmodules, is_expert: bool = False,
                 input_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None, tp_group=None,
                 name: Optional[str] = None, output_size: Optional[int] = None, **kwargs):
        super().__init__(config)
        self.name = name  # a label only (Megatron hands it to Transformer Engine)
        if getattr(submodules, "activation_func", None) is not None:
            raise NotImplementedError("MLPSubmodules.activation_func (a Transformer Engine activation module) is "
                                      "not supported; the activation comes from config.activation_func")
        self.input_size = input_size or config.hidden_size
        ffn = ffn_hidden_size or config.ffn_hidden_size
        glu = config.gated_linear_unit
        self.activation_func = config.activation_func
        # (x, bias) -> act(x + bias) in one kernel on CUDA (Megatron's --bias-gelu/swiglu-fusion).
        self.fused_activation = (fused_bias_activation(config.activation_func, glu)
                                 if config.bias_activation_fusion and not glu_extras(config) else None)
        group = {} if tp_group is None else {"tp_group": tp_group}
        self.linear_fc1 = build_module(
            submodules.linear_fc1, self.input_size, 2 * ffn if glu else ffn, config=config,
            init_method=config.init_method, gather_output=False, bias=config.add_bias_linear,
            skip_bias_add=True, is_expert=is_expert, tp_comm_buffer_name="fc1", stride=2 if glu else 1,
            **group)
        self.linear_fc2 = build_module(
            submodules.linear_fc2, ffn, output_size or config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=is_expert, tp_comm_buffer_name="fc2", **group)

    def forward(self, hidden_states, per_token_scale=None):
        """``per_token_scale`` [tokens] multiplies each token's activation before fc2 (an expert's routing
        probability, as Megatron's experts apply it)."""
        h, bias = self.linear_fc1(hidden_states)  # [s, b, (2)f/tp]
        if per_token_scale is not None and uses_weighted_squared_relu(self.config):
            return self.linear_fc2(weighted_squared_relu(h if bias is None else h + bias, per_token_scale))
        if (per_token_scale is not None and bias is None and self.fused_activation is bias_swiglu
                and triton_swiglu_available(h)):
            return self.linear_fc2(swiglu(h, per_token_scale))  # the scale inside the activation kernel
        if self.fused_activation is not None:
            h = self.fused_activation(h, bias)
        else:
            if bias is not None:
                h = h + bias
            if self.config.gated_linear_unit:  # [gate; up]: [s, b, f/tp] each
                h = glu(h, self.activation_func, self.config.glu_linear_offset,
                        self.config.activation_func_clamp_value)
            else:
                h = self.activation_func(h)
        if per_token_scale is not None:
            h = h * per_token_scale.unsqueeze(-1).to(h.dtype)
        return self.linear_fc2(h)  # (output, bias)


def apply_swiglu_sharded_factory(original_sh_ten, sharded_offsets, singleton_local_shards: bool = False,
                                 tp_group=None, dp_group=None):
    """Save a TP-local fused SwiGLU fc1 tensor [gate_r; up_r] as Megatron lays it out: a
    ShardedTensorFactory whose build splits it into the gate and up halves, each sharded over TP,
    and whose merge concatenates them again on load, so the checkpoint reshards to any TP.

    Global layout: one tensor ``key`` = [gate; up] (gate_r is fragment r, up_r fragment tp + r of
    2 * tp along axis 0), or with ``singleton_local_shards`` two tensors ``key_w`` (gate) and
    ``key_v`` (up). ``sharded_offsets`` are the prepended (e.g. per-layer) axes' offsets. A tensor
    marked ``is_torch_fsdp2_param`` and sharded over ``dp_group`` (> 1 rank) saves its DP shard of
    [gate_tp; up_tp] at its place in [gate; up]. (This application's own MLP keeps its fc1 as one
    [2, ffn, hidden] tensor, the stride-2 view; use this for modules that want Megatron's layout.)
    """
    # lazy: dist_checkpointing pulls in torch.distributed.checkpoint, ~0.9 s that a model import never needs
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory  # lazy: see above
    axis = len(sharded_offsets)  # axis 0 of the local tensor, after the prepended axes
    local_axis_size = original_sh_ten.local_shape[0]
    if original_sh_ten.global_offset[axis] % local_axis_size:
        raise ValueError(f"{original_sh_ten.key}: global offset {original_sh_ten.global_offset[axis]} is not a "
                         f"multiple of the local size {local_axis_size} along the SwiGLU axis")
    axis_frag = original_sh_ten.axis_fragmentations[axis]
    rank_offset = original_sh_ten.global_offset[axis] // local_axis_size
    dp_size = dp_group.size() if dp_group is not None else 1
    dp_sharded = getattr(original_sh_ten, "is_torch_fsdp2_param", False) and dp_size > 1

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        if singleton_local_shards:
            offsets = ((axis, rank_offset, axis_frag), (axis, rank_offset, axis_frag))
            keys = (f"{key}_w", f"{key}_v")
        else:
            offsets = ((axis, rank_offset, 2 * axis_frag), (axis, rank_offset + axis_frag, 2 * axis_frag))
            keys = (key, key)
        halves = torch.chunk(t, 2, dim=0)
        return [ShardedTensor.from_rank_offsets(k, h, *sharded_offsets, off, replica_id=replica_id,
                                                prepend_axis_num=axis)
                for k, h, off in zip(keys, halves, offsets)]

    @torch.no_grad()
    def build_dp_sharded(key, t, replica_id, flattened_range):
        if singleton_local_shards:
            raise ValueError(f"{key}: a DP-sharded SwiGLU fc1 cannot use singleton_local_shards")
        tp_size, tp_rank = tp_group.size(), tp_group.rank()
        half = original_sh_ten.global_shape[axis] // tp_size // 2  # one TP rank's gate (or up) rows
        if half % local_axis_size:
            raise ValueError(f"{key}: each DP shard must lie inside the gate or the up half")
        per_half = half // local_axis_size
        which, idx = divmod(dp_group.rank(), per_half)  # 0: gate, 1: up
        shard = which * tp_size * per_half + tp_rank * per_half + idx
        return [ShardedTensor.from_rank_offsets(key, t, *sharded_offsets, (axis, shard, axis_frag),
                                                replica_id=replica_id, prepend_axis_num=axis)]

    def merge(loaded):
        return torch.cat(loaded, dim=0) if isinstance(loaded, (list, tuple)) else loaded

    return ShardedTensorFactory(original_sh_ten.key, original_sh_ten.data,
                                build_dp_sharded if dp_sharded else build, merge, original_sh_ten.replica_id,
                                flattened_range=original_sh_ten.flattened_range)
