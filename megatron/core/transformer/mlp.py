"""Feed-forward block: fc1 (column-parallel) -> activation (GeLU / SwiGLU / squared-ReLU) -> fc2 (row-parallel)."""
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_activation import fused_bias_activation
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.spec_protocols import (  # noqa: F401  (Megatron's typing Protocols)
    LinearFc1Builder, LinearFc1Interface, LinearFc2Builder, LinearFc2Interface, TEActivationFunctionBuilder,
    TEActivationFunctionInterface)


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None
    activation_func: Union[ModuleSpec, type] = None  # Megatron's TE activation module; refused by MLP


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


class MLP(MegatronModule):
    """h -> f -> h. With ``gated_linear_unit`` fc1 emits [gate; up] (2f) and the hidden is act(gate) * up.

    fc1's weight is marked ``partition_stride=2`` under GLU: the TP=1 tensor is [gate; up] and each
    rank holds [gate_r; up_r], the r-th slice of each half.
    """

    def __init__(self, config, submodules: MLPSubmodules, is_expert: bool = False,
                 input_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None, tp_group=None,
                 name: Optional[str] = None, **kwargs):
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
                                 if config.bias_activation_fusion else None)
        self.linear_fc1 = build_module(
            submodules.linear_fc1, self.input_size, 2 * ffn if glu else ffn, config=config,
            init_method=config.init_method, gather_output=False, bias=config.add_bias_linear,
            skip_bias_add=True, is_expert=is_expert, tp_comm_buffer_name="fc1", stride=2 if glu else 1)
        self.linear_fc2 = build_module(
            submodules.linear_fc2, ffn, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=is_expert, tp_comm_buffer_name="fc2")

    def forward(self, hidden_states, per_token_scale=None):
        """``per_token_scale`` [tokens] multiplies each token's activation before fc2 (an expert's routing
        probability, as Megatron's experts apply it)."""
        h, bias = self.linear_fc1(hidden_states)  # [s, b, (2)f/tp]
        if self.fused_activation is not None:
            h = self.fused_activation(h, bias)
        else:
            if bias is not None:
                h = h + bias
            if self.config.gated_linear_unit:
                gate, up = torch.chunk(h, 2, dim=-1)  # [s, b, f/tp] each
                h = self.activation_func(gate) * up
            else:
                h = self.activation_func(h)
        if per_token_scale is not None:
            h = h * per_token_scale.unsqueeze(-1).to(h.dtype)
        return self.linear_fc2(h)  # (output, bias)
