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
from typing import Iterable, Optional

import torch

from . import dict_utils
from .mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

# decoder.layers.<i>.<rest>: group 1 the prefix up to 'layers.', group 2 the global layer index.
_LAYER_KEY = re.compile(r"^((?:.*\.)?decoder\.layers\.)(\d+)\.(.+)$")
# A stacked Megatron key: 'decoder.layers.' followed by a submodule name, not a layer index.
_STACKED_KEY = re.compile(r"^(?:.*\.)?decoder\.layers\.[A-Za-z_]")

# Megatron's local GPT layer spec: TransformerLayerSubmodules.sharded_state_dict_keys_map. Its multi-latent
# attention spec has none, so the map applies to layers with the fused linear_qkv only.
LOCAL_SPEC_KEYS_MAP = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# Fused gate/up projections that we save as [2, f, ...] and Megatron as [2f, ...].
_GATED_SUFFIXES = ("linear_fc1.weight", "linear_fc1.bias")
# MoE experts. Sequential: ours one tensor per expert, Megatron's stacked on an expert axis after the layer axis
# (mlp.experts.local_experts.<e>.linear_fc1.weight -> mlp.experts.experts.linear_fc1.weight).
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\bexperts\.)local_experts\.(\d+)\.(.+)$")
# Grouped: ours [E, out, in] per layer (the expert axis a real one), Megatron's the same stacked experts.
_GROUPED_NAMES = {"weight1": "experts.linear_fc1.weight", "weight2": "experts.linear_fc2.weight"}
_STACKED_EXPERTS = re.compile(r"^(?:.*\.)?decoder\.layers\..*\bexperts\.experts\.")


# Model families whose checkpoints a model of another family cannot read: (pattern of a tensor key, what it is,
# the entry script that builds it).
_FAMILIES = ((re.compile(r"^(?:.*\.)?decoder\.layers\.(?:\d+\.)?mixer\."), "a Mamba / hybrid model",
              "pretrain_mamba.py or pretrain_hybrid.py (with its --hybrid-override-pattern)"),
             (re.compile(r"^(?:.*\.)?vision_(?:model|projection)\."), "a multimodal (LLaVA-style) model",
              "pretrain_vlm.py"),
             (re.compile(r"^(?:.*\.)?(?:binary_head|lm_head)\."), "a BERT model", "pretrain_bert.py"),
             (re.compile(r"^(?:.*\.)?encoder\.layers\."), "an encoder (BERT / T5) model",
              "pretrain_bert.py or pretrain_t5.py"))


def missing_tensor_message(key: str, checkpoint_dir: str, saved_keys: Iterable[str]) -> str:
    """One line for a tensor the model needs and the checkpoint lacks: which model family the checkpoint holds
    when its keys tell (a Megatron-LM checkpoint of an architecture other than this run's), and what to do."""
    saved_keys = list(saved_keys)
    for pattern, what, script in _FAMILIES:
        found = next((k for k in saved_keys if pattern.match(k) and not pattern.match(key)), None)
        if found is not None:
            return (f"checkpoint {checkpoint_dir} has no tensor '{key}' that this model needs: it holds {what} "
                    f"(tensor '{found}'); load it with {script}")
    return (f"checkpoint {checkpoint_dir} has no tensor '{key}' that this model needs (saved from another "
            "architecture?); pass the checkpoint's architecture flags (--use-checkpoint-args reads them from it)")


def is_megatron_layout(checkpoint_keys: Iterable[str]) -> bool:
    """True when a checkpoint's tensor keys stack the decoder layers (Megatron Core's torch_dist layout)."""
    return any(_STACKED_KEY.match(k) for k in checkpoint_keys)


def _rename(rest: str) -> str:
    for ours, theirs in LOCAL_SPEC_KEYS_MAP.items():
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest


def _stack(sh: ShardedTensor, key: str, layer: int, num_layers: int, what: str = "layer") -> ShardedTensor:
    """``sh`` as item ``layer`` of a ``[num_layers, ...]`` tensor named ``key``."""
    if layer >= num_layers:
        flag = "--num-layers" if what == "layer" else "--num-experts"
        raise ValueError(f"ShardedTensor {sh.key}: {what} {layer} is outside a checkpoint of {num_layers} {what}s; "
                         f"build the model with the checkpoint's {flag}")
    frags = sh.axis_fragmentations or (1,) * len(sh.global_shape)
    return replace(sh, key=key, global_shape=(num_layers, *sh.global_shape), global_offset=(layer, *sh.global_offset),
                   axis_fragmentations=(num_layers, *frags), prepend_axis_num=sh.prepend_axis_num + 1)


def _gate_up_axis(sh: ShardedTensor, grouped: bool):
    """The global axis of our SwiGLU fc1's (gate, up) pair, which every rank holds whole (the TP-split axis
    follows it), or None when ``sh`` is no such tensor. ``grouped``: a real expert axis comes first."""
    if not sh.key.endswith(_GATED_SUFFIXES):
        return None
    n, local = sh.prepend_axis_num, len(sh.local_shape) - int(grouped)
    g = n + int(grouped)
    # A distributed optimizer's range piece may hold one half only (local size 1 on that axis).
    gated = local == (3 if sh.key.endswith("weight") else 2) and sh.local_shape[g - n] in (1, 2) \
        and sh.global_shape[g] == 2
    return g if gated else None


def _gate_up_piece(sh: ShardedTensor, g: int) -> ShardedTensor:
    """A piece of one half (gate or up) of our [2, f, ...] tensor as the chunk of Megatron's [2f, ...] it is."""
    n, f = sh.prepend_axis_num, sh.global_shape[g + 1]
    return replace(sh, data=None if sh.data is None else sh.data.select(g - n, 0),
                   local_shape=sh.local_shape[:g - n] + sh.local_shape[g - n + 1:],
                   global_shape=sh.global_shape[:g] + (2 * f,) + sh.global_shape[g + 2:],
                   global_offset=sh.global_offset[:g] + (sh.global_offset[g] * f + sh.global_offset[g + 1],)
                   + sh.global_offset[g + 2:], axis_fragmentations=None)


def _gate_up_factory(sh: ShardedTensor, g: int) -> ShardedTensorFactory:
    """Our [2, f/tp, ...] shard (the pair at global axis ``g``) written as two chunks of Megatron's [2f, ...]
    tensor: the gate half at the rank's offset in [0, f), the up half at f plus that offset (Megatron's
    apply_swiglu_sharded_factory)."""
    n = sh.prepend_axis_num
    f, off, frags = sh.global_shape[g + 1], sh.global_offset[g + 1], sh.axis_fragmentations

    def build(key, data, replica_id, flattened_range):
        halves = {}
        for half in range(2):
            halves[half] = replace(
                sh, data=None if data is None else data.select(g - n, half), local_shape=sh.local_shape[:g - n] +
                sh.local_shape[g - n + 1:], global_shape=sh.global_shape[:g] + (2 * f,) + sh.global_shape[g + 2:],
                global_offset=sh.global_offset[:g] + (half * f + off,) + sh.global_offset[g + 2:],
                axis_fragmentations=None if frags is None else frags[:g] + (2 * frags[g + 1],) + frags[g + 2:])
        return halves

    def merge(loaded):  # [..., f/tp, ...] x 2 -> [..., 2, f/tp, ...]
        return torch.stack([loaded[0], loaded[1]], dim=g - n)

    return ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id)


def _extra_states(sh: ShardedTensor, key: str, grouped: bool):
    """Megatron's (empty) ``_extra_state`` objects of the linear layer whose weight is ``sh`` (one per expert of a
    grouped weight), indexed like the weight's stacked axes and written by the rank that writes its first chunk."""
    n = sh.prepend_axis_num + int(grouped)
    first = sh.is_main_replica() and not any(sh.global_offset[n:])
    objs = []
    for e in range(sh.local_shape[0] if grouped else 1):
        offset = sh.global_offset[:n - 1] + (sh.global_offset[n - 1] + e,) if grouped else sh.global_offset[:n]
        objs.append(ShardedObject(key, None, sh.global_shape[:n], offset, replica_id=0 if first else 1))
    return objs


def to_megatron_layout(sharded_state_dict, num_layers: int, num_experts: Optional[int] = None,
                       extra_state: bool = True):
    """A copy of ``sharded_state_dict`` in Megatron Core's layout (module docstring); ``num_layers`` is the
    model's total layer count (the stacked axis), ``num_experts`` its MoE expert count (needed for sequential
    experts, which Megatron stacks on an expert axis). With ``extra_state`` (for saving), each linear layer of a
    transformer layer also gets Megatron's ``_extra_state`` object, which Megatron's loader asks for."""
    added = {}
    with_qkv = set()
    for _, value in dict_utils.iter_leaves(sharded_state_dict):
        m = _LAYER_KEY.match(value.key) if isinstance(value, ShardedTensor) else None
        if m is not None and m.group(3).startswith("self_attention.linear_qkv."):
            with_qkv.add((m.group(1), m.group(2)))

    def convert(path, value):
        if not isinstance(value, ShardedTensor):
            return value
        m = _LAYER_KEY.match(value.key)
        if m is None:
            return value
        prefix, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        if (prefix, m.group(2)) in with_qkv:
            rest = _rename(rest)
        sh, grouped = value, False
        expert = _SEQUENTIAL_EXPERT.match(rest)
        module, _, leaf = rest.rpartition(".")
        if expert is not None:
            if num_experts is None:
                raise ValueError(f"ShardedTensor {value.key}: a sequential expert; pass num_experts (--num-experts)")
            rest = expert.group(1) + "experts." + expert.group(3)
            sh = _stack(sh, prefix + rest, int(expert.group(2)), num_experts, what="expert")
        elif module.endswith("experts") and leaf in _GROUPED_NAMES:
            rest, grouped = module + "." + _GROUPED_NAMES[leaf], True
        sh = _stack(sh, prefix + rest, layer, num_layers)
        module, _, leaf = rest.rpartition(".")
        if extra_state and leaf == "weight" and module.rpartition(".")[2].startswith("linear_"):
            local_module = str(path[-1]).rpartition(".")[0]
            for i, obj in enumerate(_extra_states(sh, prefix + module + "._extra_state", grouped)):
                name = f"{local_module}.{module}.{i}" if grouped else local_module
                added[path[:-1] + (name + "._extra_state",)] = obj
        g = _gate_up_axis(sh, grouped)
        if g is None:
            return sh
        return _gate_up_factory(sh, g) if sh.local_shape[g - sh.prepend_axis_num] == 2 else _gate_up_piece(sh, g)

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


def stacked_sizes(checkpoint_shapes: dict):
    """(layers, experts or None) of a Megatron-layout checkpoint: the leading dim of its stacked layer tensors,
    the second of its stacked expert tensors."""
    layers = {shape[0] for key, (shape, _) in checkpoint_shapes.items() if _STACKED_KEY.match(key) and shape}
    experts = {shape[1] for key, (shape, _) in checkpoint_shapes.items() if _STACKED_EXPERTS.match(key)}
    if len(layers) != 1 or len(experts) > 1:
        raise ValueError(f"Megatron-layout checkpoint with stacked tensors of differing lengths: layers "
                         f"{sorted(layers)}, experts {sorted(experts)}")
    return layers.pop(), (experts.pop() if experts else None)
