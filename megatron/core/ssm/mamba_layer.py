"""A Mamba layer (Megatron's ``MambaLayer``): x + mixer(norm(x)), the mixer built from the spec (Mamba-2,
or any module with the same call)."""
from dataclasses import dataclass, field
from typing import Dict, Union

from megatron.core.transformer import te_key_map
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MambaLayerSubmodules:
    norm: Union[ModuleSpec, type] = IdentityOp
    mixer: Union[ModuleSpec, type] = IdentityOp
    mamba_bda: Union[ModuleSpec, type] = IdentityOp
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)
    # "transformer_engine": the state dict names the norm as Megatron's TE spec fuses it
    # (mixer.in_proj.layer_norm_weight, te_key_map.py); "local": norm.weight
    checkpoint_key_names: str = te_key_map.TRANSFORMER_ENGINE


class MambaLayer(MegatronModule):
    """[s, b, h] -> [s, b, h]. ``layer_number`` is 1-based and global (the hybrid stack passes it with
    its pipeline offset already added)."""

    def __init__(self, config, submodules: MambaLayerSubmodules, layer_number: int = 1, pg_collection=None,
                 pp_layer_offset: int = 0, name=None, **kwargs):
        super().__init__(config)
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.mixer = build_module(submodules.mixer, config, d_model=config.hidden_size, layer_number=layer_number,
                                  pg_collection=pg_collection)
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)
        self.mamba_bda = build_module(submodules.mamba_bda)
        te_key_map.install(self, submodules.checkpoint_key_names == te_key_map.TRANSFORMER_ENGINE,
                           ["mixer.in_proj", "mixer.out_proj"])

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                packed_seq_params=None, **kwargs):
        residual = hidden_states  # [s, b, h]
        if self.config.fp32_residual_connection:  # the stream is fp32; the mixer computes in the model's dtype
            residual = residual.float()
            hidden_states = hidden_states.to(self.config.params_dtype)
        out_with_bias = self.mixer(self.norm(hidden_states),
                                   inference_context=inference_context, packed_seq_params=packed_seq_params)
        return self.mamba_bda(self.training, self.config.bias_dropout_fusion)(out_with_bias, residual,
                                                                              self.hidden_dropout)
