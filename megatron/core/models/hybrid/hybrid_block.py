"""HybridStack (Megatron's name): the layers of one pipeline (virtual) stage of a hybrid model, one per
pattern symbol, plus the final norm (``final_norm``) on the last stage.

Shares TransformerBlock's forward machinery (input from the previous stage, activation recompute, RNG
under sequence parallelism); only how layers are chosen and numbered differs.
"""
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, process_group_kwargs
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer


@dataclass
class HybridStackSubmodules:
    """The layer spec of each symbol (Megatron's fields; dsa_layer is not built here)."""

    mamba_layer: Union[ModuleSpec, type] = IdentityOp
    gdn_layer: Union[ModuleSpec, type] = IdentityOp
    attention_layer: Union[ModuleSpec, type] = IdentityOp
    dsa_layer: Union[ModuleSpec, type] = IdentityOp
    mla_layer: Union[ModuleSpec, type] = IdentityOp
    mlp_layer: Union[ModuleSpec, type] = IdentityOp
    moe_layer: Union[ModuleSpec, type] = IdentityOp
    mtp_block_spec: Optional[ModuleSpec] = None
    final_norm: Union[ModuleSpec, type] = WrappedTorchNorm


_SPEC_OF = {Symbols.MAMBA: "mamba_layer", Symbols.GDN: "gdn_layer", Symbols.ATTENTION: "attention_layer",
            Symbols.MLA: "mla_layer", Symbols.MLP: "mlp_layer", Symbols.MOE: "moe_layer"}


class HybridStack(TransformerBlock):
    """Layers for ``layer_type_list`` (this stage's symbols); ``pp_layer_offset``: global index of the
    first, so layer numbers (and parameter names, init seeds, checkpoint keys) are global."""

    def __init__(self, config, submodules: HybridStackSubmodules, pre_process: bool = True,
                 layer_type_list: Optional[List[str]] = None, pp_layer_offset: int = 0, post_layer_norm: bool = True,
                 post_process: bool = True, device=None, dtype=None, pg_collection=None, is_mtp_layer: bool = False,
                 name: Optional[str] = None, vp_stage: Optional[int] = None):
        if config.hidden_size <= 0:
            raise ValueError(f"TransformerConfig.hidden_size is {config.hidden_size}: set it (--hidden-size)")
        MegatronModule.__init__(self, config)
        self.submodules = submodules
        self.pre_process, self.post_process = pre_process, post_process
        self.pg_collection, self.vp_stage = pg_collection, vp_stage
        self.input_tensor = None
        self.layer_type_list = list(layer_type_list or [])
        self.layers = torch.nn.ModuleList(
            self._build_layer(symbol, pp_layer_offset + i + 1) for i, symbol in enumerate(self.layer_type_list))
        self.final_layernorm = None  # TransformerBlock's name; the hybrid stack's norm is final_norm
        if post_process and post_layer_norm:
            self.final_norm = build_module(submodules.final_norm, config=config, hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)

    def _build_layer(self, symbol: str, layer_number: int):
        spec = getattr(self.submodules, _SPEC_OF[symbol])
        if spec is IdentityOp:
            raise ValueError(f"the hybrid stack spec has no layer for '{symbol}' ({_SPEC_OF[symbol]})")
        kwargs = process_group_kwargs(spec, self.pg_collection, "HybridStack")
        module = spec.module if isinstance(spec, ModuleSpec) else spec
        if isinstance(module, type) and issubclass(module, TransformerLayer):
            kwargs["add_layer_offset"] = False  # layer_number is already global
        return build_module(spec, config=self.config, layer_number=layer_number, **kwargs)

    def _layer_call(self, layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs):
        out = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # TransformerLayer: (hidden, context); MambaLayer: hidden

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        hidden_states = super().forward(hidden_states, attention_mask=attention_mask, **kwargs)
        if getattr(self, "final_norm", None) is not None:
            hidden_states = self.final_norm(hidden_states)
        return hidden_states
