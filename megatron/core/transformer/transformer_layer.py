"""One pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(.)), with bias-dropout-add."""
from abc import ABC
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megatron.core.fusions.compile import _raise_recompile_limit
from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer import te_key_map
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.layer_offsets import get_transformer_layer_offset, pipeline_coords
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_protocols import MlpBuilder, MlpInterface  # noqa: F401  (typing Protocols)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, process_group_kwargs


def get_bias_dropout_add(training: bool, fused: bool):
    """Megatron's bda factory; the plain version serves both (torch.compile may fuse it)."""
    def bda(x_with_bias, residual, prob):
        return _bias_dropout_add(x_with_bias, residual, prob, training)
    return bda


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    sharded_state_dict_keys_map: dict = field(default_factory=dict)
    # "transformer_engine": the state dict keeps Megatron's TE-spec key names (te_key_map.py)
    checkpoint_key_names: str = "local"


class BaseTransformerLayer(ABC):
    """Marker base of transformer layers (Megatron's): ``isinstance(m, BaseTransformerLayer)``."""


class TransformerLayer(MegatronModule, BaseTransformerLayer):
    """``layer_number`` is 1-based and global (across pipeline stages)."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None, vp_stage: Optional[int] = None,
                 is_mtp_layer: bool = False, add_layer_offset: bool = True, pp_layer_offset: Optional[int] = None,
                 name: Optional[str] = None, **kwargs):
        """``layer_number`` counts from 1 within this pipeline stage (as TransformerBlock passes it): the
        stage's offset is added unless ``add_layer_offset`` is False or this is an MTP depth's layer
        (``is_mtp_layer``, numbered within MTP; its MoE router logs after the decoder's layers).
        ``pp_layer_offset`` indexes Megatron's inference KV cache by stage; the generation engine here
        keys its cache by global layer number, so only None is accepted. ``pg_collection``: explicit process
        groups for attention and the MLP (its ``pp`` group gives the stage offset); parallel_state's when None."""
        super().__init__(config)
        if pp_layer_offset is not None:
            raise NotImplementedError("TransformerLayer(pp_layer_offset=...) is not supported: the KV cache is "
                                      "indexed by the global layer number")
        self.name = name  # a label only (Megatron hands it to Transformer Engine)
        self.submodules_config = submodules
        self.is_mtp_layer = is_mtp_layer
        self.pg_collection = pg_collection
        if add_layer_offset and not is_mtp_layer:
            layer_number = layer_number + get_transformer_layer_offset(
                config, vp_stage, **pipeline_coords(pg_collection, "TransformerLayer"))
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        eps = config.layernorm_epsilon
        self.input_layernorm = build_module(submodules.input_layernorm, config=config,
                                            hidden_size=config.hidden_size, eps=eps)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number,
                                           **self._groups_for(submodules.self_attention))
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        # Decoder layers of encoder-decoder models (T5): attend to the encoder output ("context").
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, config=config,
                                                     hidden_size=config.hidden_size, eps=eps)
        self.cross_attention = build_module(submodules.cross_attention, config=config, layer_number=layer_number,
                                            **self._groups_for(submodules.cross_attention))
        self.cross_attn_bda = build_module(submodules.cross_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config,
                                              hidden_size=config.hidden_size, eps=eps)
        self.mlp = build_module(submodules.mlp, config=config, **({"is_mtp_layer": True} if is_mtp_layer else {}),
                                **self._groups_for(submodules.mlp))
        if hasattr(self.mlp, "set_layer_number"):  # MoE layers log their losses per layer
            self.mlp.set_layer_number(layer_number)
        if not is_mtp_layer and config.is_bf16_layer(layer_number):
            # --first-last-layers-bf16: this layer's linears run in 16 bits (their FP8 choice is made when
            # they are built; the TP overlap stays as FP8 had set it, off).
            for module in self.modules():
                if getattr(module, "fp8_format", None) is not None:
                    module.fp8_format = None
        self.mlp_bda = build_module(submodules.mlp_bda)
        self.recompute_norm = (config.recompute_granularity == "selective"
                               and "layernorm" in (config.recompute_modules or []))
        # Megatron's modules: "mlp" recomputes a dense MLP, "moe" an MoE layer (router, exchange and experts)
        moe = getattr(self.mlp, "router", None) is not None
        self.recompute_mlp = (config.recompute_granularity == "selective"
                              and ("moe" if moe else "mlp") in (config.recompute_modules or []))
        te_key_map.install(self, getattr(submodules, "checkpoint_key_names", "local") == te_key_map.TRANSFORMER_ENGINE,
                           self._te_module_paths())

    def _te_module_paths(self):
        """The submodules that Megatron's TE spec builds from Transformer Engine modules (linears, core
        attention, grouped experts): each has an ``_extra_state`` in a TE-spec state dict."""
        paths = [name for name, m in self.named_modules()
                 if isinstance(m, (ColumnParallelLinear, RowParallelLinear, DotProductAttention))]
        experts = getattr(self.mlp, "experts", None)
        if hasattr(experts, "weight1"):
            paths += ["mlp.experts.linear_fc1", "mlp.experts.linear_fc2"]
        return paths

    def _groups_for(self, spec) -> dict:
        """Explicit groups for a submodule: MoE and attention take the collection, MLP its TP group."""
        return process_group_kwargs(spec, self.pg_collection, "TransformerLayer")

    def _bda(self, bda_module):
        if isinstance(bda_module, IdentityFuncOp) or not callable(bda_module):
            return bda_module
        return bda_module(self.training, self.config.bias_dropout_fusion)

    def _norm(self, norm, x):
        if self.recompute_norm and self.training and not isinstance(norm, IdentityOp):
            return checkpoint(norm, False, x)
        return norm(x)

    def _mlp_with_bias(self, x):
        out, bias = self.mlp(x)
        return out if bias is None else out + bias

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        # hidden_states: [s, b, h] (s/tp under sequence parallelism). A part whose module is identity is
        # skipped (the MLP-only and attention-only layers of hybrid models).
        if not isinstance(self.self_attention, IdentityOp):
            residual = hidden_states
            x = self._norm(self.input_layernorm, hidden_states)
            attn_out = self.self_attention(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                           attention_bias=attention_bias, inference_context=inference_context,
                                           packed_seq_params=packed_seq_params)
            if self.config.apply_residual_connection_post_layernorm:
                residual = x
            hidden_states = self._bda(self.self_attn_bda)(attn_out, residual, self.hidden_dropout)

        if not isinstance(self.cross_attention, IdentityOp):
            residual = hidden_states
            x = self._norm(self.pre_cross_attn_layernorm, hidden_states)
            cross_out = self.cross_attention(x, attention_mask=context_mask, key_value_states=context)
            if self.config.apply_residual_connection_post_layernorm:
                residual = x
            hidden_states = self._bda(self.cross_attn_bda)(cross_out, residual, self.hidden_dropout)

        if isinstance(self.mlp, IdentityOp):
            return hidden_states, context
        residual = hidden_states
        x = self._norm(self.pre_mlp_layernorm, hidden_states)
        if self.recompute_mlp and self.training:
            mlp_out = (checkpoint(self._mlp_with_bias, False, x), None)
        else:
            mlp_out = self.mlp(x)
        if self.config.apply_residual_connection_post_layernorm:
            residual = x
        hidden_states = self._bda(self.mlp_bda)(mlp_out, residual, self.hidden_dropout)
        return hidden_states, context


class MoETransformerLayer(TransformerLayer):
    """A TransformerLayer of an MoE model, Megatron's type for MoE layers (its partial CUDA-graph capture
    of router / experts / post-processing is not implemented: --cuda-graph-impl full_iteration only)."""

    def __init__(self, *args, **kwargs):
        self.is_moe_layer = True
        self.use_partial_cudagraphs = False
        super().__init__(*args, **kwargs)


def compile_transformer_layers(model: torch.nn.Module, backend: str = "inductor", mode=None) -> int:
    """Compile every TransformerLayer of ``model`` in place; returns how many were compiled.

    Layers share code and (with nn-module inlining, torch's default) take params as graph inputs, so
    dynamo traces once and every layer reuses the graph; the rest of the model stays eager, which keeps
    the pipeline/DDP hooks and the loss outside the compiled region. A graph break inside a layer
    (e.g. selective recompute's checkpoint) only splits the graph, it does not change results.
    """
    # Many identical layers: raise the recompile budget so a few shape/guard variants never fall back.
    _raise_recompile_limit()
    count = 0
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.compile(backend=backend, mode=mode, dynamic=False)
            count += 1
    return count
