"""Megatron-LM's torch_dist layout of a GPT's transformer layers, for checkpoints that interchange with it.

Our sharded state dicts save each layer's tensor under its own global name
(``decoder.layers.3.self_attention.linear_qkv.weight``, shape ``[3h, h]``). Megatron Core stacks the
layers instead: one tensor per kind, with a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight``,
shape ``[L, 3h, h]``, layer 3 at offset 3), the local spec's norms under Transformer Engine's names
(``input_layernorm.weight`` -> ``self_attention.linear_qkv.layer_norm_weight``), a SwiGLU fc1 as one
``[2f, h]`` tensor (ours: ``[2, f, h]``, the same bytes), and an ``_extra_state`` object per linear layer.

`to_megatron_layout` rewrites a sharded state dict into that layout; the dict's own keys (the paths that
``model.load_state_dict`` reads) stay as they are, so a load through it returns our usual state dict.
`dist_checkpointing.load` applies it by itself when the checkpoint is in Megatron's layout.
"""
import re
from dataclasses import replace
from typing import Iterable

import torch

from . import dict_utils
from .mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

# decoder.layers.<i>.<rest>: group 1 the prefix up to 'layers.', group 2 the global layer index.
_LAYER_KEY = re.compile(r"^((?:.*\.)?decoder\.layers\.)(\d+)\.(.+)$")
# A stacked Megatron key: 'decoder.layers.' followed by a submodule name, not a layer index.
_STACKED_KEY = re.compile(r"^(?:.*\.)?decoder\.layers\.[A-Za-z_]")

# Megatron's local GPT layer spec: TransformerLayerSubmodules.sharded_state_dict_keys_map.
LOCAL_SPEC_KEYS_MAP = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# Fused gate/up projections that we save as [2, f, ...] and Megatron as [2f, ...].
_GATED_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def is_megatron_layout(checkpoint_keys: Iterable[str]) -> bool:
    """True when a checkpoint's tensor keys stack the decoder layers (Megatron Core's torch_dist layout)."""
    return any(_STACKED_KEY.match(k) for k in checkpoint_keys)


def _rename(rest: str) -> str:
    for ours, theirs in LOCAL_SPEC_KEYS_MAP.items():
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest


def _stack(sh: ShardedTensor, key: str, layer: int, num_layers: int) -> ShardedTensor:
    """``sh`` as layer ``layer`` of a ``[num_layers, ...]`` tensor named ``key``."""
    if layer >= num_layers:
        raise ValueError(f"ShardedTensor {sh.key}: layer {layer} is outside a checkpoint of {num_layers} layers; "
                         "build the model with the checkpoint's --num-layers")
    frags = sh.axis_fragmentations or (1,) * len(sh.global_shape)
    return replace(sh, key=key, global_shape=(num_layers, *sh.global_shape), global_offset=(layer, *sh.global_offset),
                   axis_fragmentations=(num_layers, *frags), prepend_axis_num=sh.prepend_axis_num + 1)


def _is_gate_up_stack(sh: ShardedTensor) -> bool:
    """Our SwiGLU fc1: a leading axis of 2 (gate, up) that every rank holds whole, then the TP-split axis."""
    n = sh.prepend_axis_num
    return (sh.key.endswith(_GATED_SUFFIXES) and len(sh.local_shape) == (3 if sh.key.endswith("weight") else 2)
            and sh.local_shape[0] == 2 and sh.global_shape[n] == 2)


def _gate_up_factory(sh: ShardedTensor) -> ShardedTensorFactory:
    """Our [2, f/tp, ...] shard written as two chunks of Megatron's [2f, ...] tensor: the gate half at the
    rank's offset in [0, f), the up half at f plus that offset (Megatron's apply_swiglu_sharded_factory)."""
    n = sh.prepend_axis_num
    f, off, tp = sh.global_shape[n + 1], sh.global_offset[n + 1], (sh.axis_fragmentations or ())[n + 1:n + 2]
    tp = tp[0] if tp else 1

    def build(key, data, replica_id, flattened_range):
        halves = {}
        for half in range(2):
            halves[half] = replace(
                sh, data=None if data is None else data[half], local_shape=sh.local_shape[1:],
                global_shape=sh.global_shape[:n] + (2 * f,) + sh.global_shape[n + 2:],
                global_offset=sh.global_offset[:n] + (half * f + off,) + sh.global_offset[n + 2:],
                axis_fragmentations=sh.axis_fragmentations[:n] + (2 * tp,) + sh.axis_fragmentations[n + 2:])
        return halves

    def merge(loaded):  # [f/tp, ...] x 2 -> [2, f/tp, ...]
        return torch.stack([loaded[0], loaded[1]])

    return ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id)


def _extra_state(sh: ShardedTensor, key: str, layer: int, num_layers: int) -> ShardedObject:
    """Megatron's (empty) ``_extra_state`` of the linear layer whose weight is ``sh``, written by the rank that
    writes the weight's first chunk."""
    first = sh.is_main_replica() and not any(sh.global_offset[sh.prepend_axis_num:])
    return ShardedObject(key, None, (num_layers,), (layer,), replica_id=0 if first else 1)


def to_megatron_layout(sharded_state_dict, num_layers: int, extra_state: bool = True):
    """A copy of ``sharded_state_dict`` in Megatron Core's layout (module docstring); ``num_layers`` is the
    model's total layer count (the stacked axis). With ``extra_state`` (for saving), each linear layer of a
    transformer layer also gets Megatron's ``_extra_state`` object, which Megatron's loader asks for."""
    added = {}

    def convert(path, value):
        if not isinstance(value, ShardedTensor):
            return value
        m = _LAYER_KEY.match(value.key)
        if m is None:
            return value
        prefix, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        sh = _stack(value, prefix + _rename(rest), layer, num_layers)
        module, _, leaf = rest.rpartition(".")
        if extra_state and leaf == "weight" and module.rpartition(".")[2].startswith("linear_"):
            local_module = str(path[-1]).rpartition(".")[0]
            added[path[:-1] + (local_module + "._extra_state",)] = _extra_state(
                sh, prefix + module + "._extra_state", layer, num_layers)
        return _gate_up_factory(sh) if _is_gate_up_stack(sh) else sh

    out = _map_with_paths(convert, sharded_state_dict, ())
    for path, obj in added.items():
        dict_utils.set_path(out, path, obj)
    return out


def _map_with_paths(fn, tree, path):
    if isinstance(tree, dict):
        return {k: _map_with_paths(fn, v, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_with_paths(fn, v, path + (i,)) for i, v in enumerate(tree)]
    return fn(path, tree)


def num_stacked_layers(checkpoint_shapes: dict) -> int:
    """The layer count of a Megatron-layout checkpoint: the leading dim of its stacked layer tensors."""
    counts = {shape[0] for key, (shape, _) in checkpoint_shapes.items() if _STACKED_KEY.match(key) and shape}
    if len(counts) != 1:
        raise ValueError(f"Megatron-layout checkpoint with stacked layer tensors of differing lengths {sorted(counts)}")
    return counts.pop()
