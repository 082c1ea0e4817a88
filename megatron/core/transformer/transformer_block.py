"""The stack of transformer layers of one pipeline (virtual) stage, plus the final norm on the last.

Which layers a stage builds (and their global numbers) is decided in ``layer_offsets.py``.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megatron.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker
from megatron.core.transformer.activation_offload import ActivationOffload, parameter_storages
from megatron.core.transformer.layer_offsets import (  # noqa: F401  (layers_per_pipeline_rank: its old path)
    get_num_layers_to_build,
    get_transformer_layer_offset,
    layers_per_pipeline_rank,
    pipeline_coords,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, process_group_kwargs
from megatron.core.transformer.te_key_map import load_hook
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.utils import make_viewless_tensor


@dataclass
class TransformerBlockSubmodules:
    layer_specs: Optional[List[ModuleSpec]] = None  # None: no layers (Megatron's default)
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def _get_block_submodules(config, spec) -> TransformerBlockSubmodules:
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        return spec.submodules
    # A single layer spec: repeat it num_layers times.
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers)


class TransformerBlock(MegatronModule):
    """``pg_collection``: explicit process groups for every layer (its ``pp`` group places the layers);
    parallel_state's groups when None."""

    def __init__(self, config, spec, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, vp_stage: Optional[int] = None, **kwargs):
        if config.hidden_size <= 0:
            raise ValueError(f"TransformerConfig.hidden_size is {config.hidden_size} (Megatron's unset default): "
                             "set it (--hidden-size) before building a model")
        super().__init__(config)
        # TE-spec checkpoints: the final TENorm's _extra_state (newer Transformer Engine) is read and dropped
        self._register_load_state_dict_pre_hook(load_hook, with_module=True)
        self.submodules = _get_block_submodules(config, spec)
        self.pre_process, self.post_process = pre_process, post_process
        self.vp_stage = vp_stage
        self.pg_collection = pg_collection
        self.input_tensor = None
        pp = pipeline_coords(pg_collection, "TransformerBlock")
        num_layers = get_num_layers_to_build(config, vp_stage, **pp)
        offset = get_transformer_layer_offset(config, vp_stage, **pp)
        specs = self.submodules.layer_specs or []
        if len(specs) == config.num_layers:
            specs = specs[offset:offset + num_layers]
        elif len(specs) != num_layers:
            raise ValueError(f"block spec has {len(specs)} layer specs; expected {config.num_layers} or {num_layers}")
        self.layers = torch.nn.ModuleList(
            build_module(s, config=config, layer_number=i + 1, vp_stage=vp_stage,  # the layer adds `offset`
                         **process_group_kwargs(s, pg_collection, "TransformerBlock"))
            for i, s in enumerate(specs))
        self.final_layernorm = None
        if post_process and post_layer_norm:
            norm_spec = self.submodules.layer_norm
            if norm_spec is None:
                norm_spec = WrappedTorchNorm
            self.final_layernorm = build_module(norm_spec, config=config, hidden_size=config.hidden_size,
                                                eps=config.layernorm_epsilon)

    def set_input_tensor(self, input_tensor):
        """Activation received from the previous pipeline stage; used instead of ``hidden_states``."""
        self.input_tensor = input_tensor

    def _layer_call(self, layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs):
        return layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)[0]

    def _recompute_layer(self, index: int) -> bool:
        c = self.config
        # 'block': checkpoint each of the first recompute_num_layers layers of this stage
        # ('uniform' is handled in _forward_layers, one checkpoint per group of N layers).
        if c.recompute_granularity != "full" or not self.training or c.recompute_method != "block":
            return False
        return index < c.recompute_num_layers

    def _forward_layers(self, hidden_states, attention_mask, rotary_pos_emb, **kwargs):
        c = self.config
        if c.recompute_granularity == "full" and self.training and c.recompute_method == "uniform":
            n = c.recompute_num_layers
            for start in range(0, len(self.layers), n):
                chunk = self.layers[start:start + n]

                def run(h, m, r, chunk=chunk):
                    for layer in chunk:
                        h = self._layer_call(layer, h, m, r, **kwargs)
                    return h
                hidden_states = checkpoint(run, False, hidden_states, attention_mask, rotary_pos_emb)
            return hidden_states
        for i, layer in enumerate(self.layers):
            if self._recompute_layer(i):
                hidden_states = checkpoint(
                    lambda h, m, r, layer=layer: self._layer_call(layer, h, m, r, **kwargs), False,
                    hidden_states, attention_mask, rotary_pos_emb)
            elif self._offload_layer(i):
                with ActivationOffload(parameter_storages(layer)):
                    hidden_states = self._layer_call(layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs)
            else:
                hidden_states = self._layer_call(layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs)
        return hidden_states

    def _offload_layer(self, index: int) -> bool:
        """--cpu-offloading-num-layers: the first N layers of the model (one pipeline stage: refused otherwise)
        keep their saved activations in host memory while training."""
        c = self.config
        return (getattr(c, "cpu_offloading", False) and self.training and torch.is_grad_enabled()
                and index < c.cpu_offloading_num_layers)

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if not self.pre_process:
            hidden_states = self.input_tensor  # [s, b, h] from the previous stage
        hidden_states = make_viewless_tensor(hidden_states, requires_grad=True, keep_graph=True)
        attention_mask = _simplify_causal_mask(attention_mask)
        # Under SP the activations are split over TP, so dropout must differ per rank.
        rng = get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        # Decoder blocks of encoder-decoder models also take the encoder output and its mask.
        cross = {} if context is None else {"context": context, "context_mask": context_mask}
        if packed_seq_params is not None:
            cross["packed_seq_params"] = packed_seq_params
        if inference_context is not None:  # generation: each attention reads/writes its KV cache
            cross["inference_context"] = inference_context
        with rng:
            hidden_states = self._forward_layers(hidden_states, attention_mask, rotary_pos_emb, **cross)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(hidden_states, requires_grad=True, keep_graph=True)
        return hidden_states


def _simplify_causal_mask(mask):
    """None when ``mask`` is the plain causal mask for every sample (True = masked above the diagonal),
    so attention can take SDPA's is_causal fast path; otherwise the mask unchanged."""
    if mask is None:
        return None
    sq, sk = mask.shape[-2], mask.shape[-1]
    causal = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=mask.device), diagonal=1)
    return None if bool((mask == causal).all()) else mask

