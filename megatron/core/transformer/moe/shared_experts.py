"""Shared experts: a dense MLP every token goes through, added to the routed experts' output (DeepSeek,
Qwen-MoE). A normal TP-split MLP on the layer input; MoELayer may overlap it with the token dispatch.
With ``gate`` (--moe-shared-expert-gate, Qwen2-MoE) its output is scaled per token by
sigmoid(x . gate_weight). ``pg_collection``: its ``tp`` group splits the MLP (parallel_state's when None)."""
from typing import Optional

import torch

from megatron.core.process_groups_config import get_pg
from megatron.core.tensor_parallel.layers import _make_param
from megatron.core.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    def __init__(self, config, submodules, gate: bool = False, pg_collection=None, name: Optional[str] = None):
        tp_group = None if pg_collection is None else get_pg(pg_collection, "tp", "SharedExpertMLP")
        super().__init__(config, submodules, ffn_hidden_size=config.moe_shared_expert_intermediate_size,
                         tp_group=tp_group, name=name)
        self.use_shared_expert_gate = gate
        self.gate_weight = None
        if gate:
            self.gate_weight = _make_param((1, config.hidden_size), config, config.init_method)
            # Replicated over TP; under sequence parallelism each rank gates its own tokens: sum the grads.
            self.gate_weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states):
        out, bias = super().forward(hidden_states)
        out = out if bias is None else out + bias
        if self.gate_weight is not None:
            gate = torch.nn.functional.linear(hidden_states, self.gate_weight.to(hidden_states.dtype))
            out = out * torch.sigmoid(gate)
        return out
