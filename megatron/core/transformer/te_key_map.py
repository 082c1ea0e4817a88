"""Megatron's Transformer Engine checkpoint names <-> this project's local names: the one key map.

Megatron's TE layer spec fuses the pre-attention norm into ``linear_qkv`` and a dense MLP's pre-norm into
``linear_fc1`` (TE's LayerNormLinear: ``layer_norm_weight`` / ``layer_norm_bias``), stores grouped experts as
TE GroupedLinear's ``weight0..weight{E-1}`` and gives every TE module an ``_extra_state`` (its FP8 metadata;
no FP8 state without --fp8). Our layers compute the same functions under the local names. A layer built
from the TE spec writes its state dict through this table, and every layer reads either naming, so a
checkpoint saved under one spec loads under the other (and Megatron's TE-spec state dicts load here).
Sources: Megatron-LM megatron/core/models/gpt/gpt_layer_specs.py
(get_gpt_layer_with_transformer_engine_submodules; its local spec's sharded_state_dict_keys_map names the
same two norm fusions), Transformer Engine pytorch/module/layernorm_linear.py and grouped_linear.py.
"""
import contextlib
import io
import pickle

import torch

TRANSFORMER_ENGINE = "transformer_engine"

# (local key prefix, TE key prefix, which layers), relative to a layer; each renames weight and bias.
NORM_FUSIONS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_", "attention"),  # SelfAttention (MLA keeps it)
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_", "dense_mlp"),  # MoE layers keep a separate TENorm
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_", "mla"),  # MLA --qk-layernorm
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_", "mla"),
    ("norm.", "mixer.in_proj.layer_norm_", "mamba"),  # hybrid models' Mamba layers (Megatron's hybrid spec)
    ("input_layernorm.", "self_attention.in_proj.layer_norm_", "gdn"),  # Gated DeltaNet layers
)
# Grouped-GEMM experts: our stacked [E_local, out, in] parameter <-> TE GroupedLinear's per-expert weights.
GROUPED_EXPERTS = (("mlp.experts.weight1", "mlp.experts.linear_fc1.weight"),
                   ("mlp.experts.weight2", "mlp.experts.linear_fc2.weight"))
EXTRA_STATE = "_extra_state"


def layer_kinds(layer) -> set:
    """Which NORM_FUSIONS rows apply to ``layer`` (a TransformerLayer built from the TE spec)."""
    kinds = set()
    attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    if hasattr(attention, "linear_qkv"):
        kinds.add("attention")
    if hasattr(attention, "linear_q_up_proj"):
        kinds.add("mla")
    if hasattr(attention, "in_proj"):
        kinds.add("gdn")
    if hasattr(getattr(layer, "mixer", None), "in_proj"):
        kinds.add("mamba")
    if mlp is not None and hasattr(mlp, "linear_fc1"):
        kinds.add("dense_mlp")
    return kinds


def install(layer, te_names: bool, extra_state_modules=()):
    """Hook ``layer``'s state dict: TE names on save when ``te_names`` (with an empty ``_extra_state`` for
    each of ``extra_state_modules``, layer-relative paths of modules TE would implement); both namings and
    ``_extra_state`` entries accepted on load."""
    layer._te_names = te_names
    layer._te_kinds = layer_kinds(layer)
    layer._te_extra_state = tuple(extra_state_modules)
    layer._register_state_dict_hook(_save_hook)
    layer._register_load_state_dict_pre_hook(load_hook, with_module=True)


def _renames(kinds):
    return [(local, te) for local, te, kind in NORM_FUSIONS if kind in kinds]


def _save_hook(layer, state_dict, prefix, local_metadata):
    if not getattr(layer, "_te_names", False):
        return
    keys = [k for k in state_dict if k.startswith(prefix)]
    items = [(k[len(prefix):], state_dict.pop(k)) for k in keys]
    renames = _renames(layer._te_kinds)
    for key, value in items:
        for local, te in renames:
            if key.startswith(local):
                key = te + key[len(local):]
        grouped = dict(GROUPED_EXPERTS).get(key)
        if grouped is not None:  # TE GroupedLinear numbers the experts of this rank from 0
            for i in range(value.shape[0]):
                state_dict[f"{prefix}{grouped}{i}"] = value[i]
            continue
        state_dict[prefix + key] = value
    for module in layer._te_extra_state:  # no FP8 state: TE writes an empty uint8 tensor
        state_dict[f"{prefix}{module}.{EXTRA_STATE}"] = torch.empty(0, dtype=torch.uint8)


def load_hook(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rel = key[len(prefix):]
        if rel.endswith(EXTRA_STATE):
            check_extra_state(key, state_dict.pop(key))
            continue
        for local, te, _ in NORM_FUSIONS:
            if rel.startswith(te):
                state_dict[prefix + local + rel[len(te):]] = state_dict.pop(key)
    for local, te in GROUPED_EXPERTS:
        weights = []
        while f"{prefix}{te}{len(weights)}" in state_dict:
            weights.append(state_dict.pop(f"{prefix}{te}{len(weights)}"))
        if weights:
            state_dict[prefix + local] = torch.stack(weights)


def _extra_state_value(tensor):
    """TE's pickled extra state: None or a dict (TE >= 1.6: a uint8 tensor of pickle bytes; earlier: a
    BytesIO of torch.save)."""
    if isinstance(tensor, io.BytesIO):
        tensor.seek(0)
        return torch.load(tensor, weights_only=False) if tensor.getbuffer().nbytes else None
    if tensor is None or (torch.is_tensor(tensor) and tensor.numel() == 0):
        return None
    if torch.is_tensor(tensor):
        return pickle.loads(tensor.detach().cpu().numpy().tobytes())
    return tensor


def has_fp8_scaling_state(tensor) -> bool:
    """True when a Transformer Engine ``_extra_state`` carries FP8 scaling state (scales, amax history)."""
    value = _extra_state_value(tensor)
    if not value:
        return False
    return not (isinstance(value, dict) and not any(k.startswith(("scale", "amax")) and value[k] is not None
                                                    for k in value))


def check_extra_state(key: str, tensor) -> None:
    """Accept an ``_extra_state`` that carries no FP8 state; refuse one whose FP8 scales we cannot honour."""
    if not has_fp8_scaling_state(tensor):
        return
    raise ValueError(f"{key}: Transformer Engine FP8 scaling state (amax history / scales of a delayed-scaling "
                     "--fp8 run) cannot be honoured here (our FP8 recomputes tensorwise scales every step); "
                     "drop the _extra_state entries from the checkpoint to load its weights without it")


@contextlib.contextmanager
def local_names(model: torch.nn.Module):
    """Within the block, ``model.state_dict()`` uses local names everywhere (initialization and the
    checkpoint layout key parameters by their local names)."""
    layers = [m for m in model.modules() if getattr(m, "_te_names", False)]
    for m in layers:
        m._te_names = False
    try:
        yield
    finally:
        for m in layers:
            m._te_names = True


def rename_sharded(model: torch.nn.Module, sharded: dict, prefix: str = "") -> dict:
    """Give the norm tensors of TE-spec layers their TE names in a sharded state dict built from local names
    (dict keys and ShardedTensor keys; grouped experts stay stacked along the expert dim)."""
    for path, layer in model.named_modules():
        if not getattr(layer, "_te_names", False):
            continue
        base = f"{prefix}{path}." if path else prefix
        for local, te in _renames(layer._te_kinds):
            for key in [k for k in sharded if k.startswith(base + local)]:
                sh = sharded.pop(key)
                tail = key[len(base):]
                sh.key = sh.key[:len(sh.key) - len(tail)] + te + tail[len(local):]
                sharded[base + te + tail[len(local):]] = sh
    return sharded


def alternative_key(key: str):
    """The other spec's name of a checkpoint key (a global tensor name, optimizer keys included), or None."""
    for local, te, _ in NORM_FUSIONS:
        for a, b in ((te, local), (local, te)):
            cut = key.rfind("." + a)
            if cut >= 0:
                return key[:cut + 1] + b + key[cut + 1 + len(a):]
    return None
