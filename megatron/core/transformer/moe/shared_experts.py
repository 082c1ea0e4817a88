"""Shared experts: a dense MLP every token goes through, added to the routed experts' output (DeepSeek,
Qwen-MoE). A normal TP-split MLP on the layer input; MoELayer may overlap it with the token dispatch."""
from megatron.core.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    def __init__(self, config, submodules, gate: bool = False, pg_collection=None):
        if gate:
            raise NotImplementedError("--moe-shared-expert-gate is not supported; drop the flag")
        super().__init__(config, submodules, ffn_hidden_size=config.moe_shared_expert_intermediate_size)

    def forward(self, hidden_states):
        out, bias = super().forward(hidden_states)
        return out if bias is None else out + bias
