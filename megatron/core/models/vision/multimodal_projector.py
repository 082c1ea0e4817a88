"""MultimodalProjector: vision features [s, n, h_vision] -> the language model's width [s, n, h_language]."""
import torch

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import make_viewless_tensor

PROJECTOR_TYPES = ("mlp", "affine")


class MultimodalProjector(MegatronModule):
    """``projector_type`` "mlp": fc1 (column-parallel, input_size -> config.ffn_hidden_size), the config's
    activation, fc2 (row-parallel, -> config.hidden_size): LLaVA-1.5's two-layer projector.
    "affine": one linear (``submodules.linear_fc1``, output gathered over TP) input_size -> hidden_size.
    ``tp_group`` / ``pg_collection``: explicit TP group; parallel_state's when None."""

    def __init__(self, config, submodules: MLPSubmodules, projector_type: str, input_size: int,
                 tp_group=None, pg_collection=None):
        super().__init__(config=config)
        if projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"vision projection type '{projector_type}' is not supported; use one of "
                             f"{PROJECTOR_TYPES}")
        if submodules is None:
            raise ValueError("MultimodalProjector needs MLPSubmodules (linear_fc1 / linear_fc2)")
        self.projector_type = projector_type
        tp_group = pg_collection.tp if pg_collection is not None else tp_group
        if projector_type == "mlp":
            self.encoder = MLP(config=config, submodules=submodules, input_size=input_size, tp_group=tp_group)
        else:
            self.encoder = submodules.linear_fc1(
                input_size, config.hidden_size, config=config, init_method=config.init_method, gather_output=True,
                bias=config.add_bias_linear, skip_bias_add=True, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, bias = self.encoder(hidden_states)
        if bias is not None:
            out = out + bias
        # A view would trip the pipeline's output deallocation; hand over a fresh tensor.
        return make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)
