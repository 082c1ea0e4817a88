"""Enums used by transformer modules (values match Megatron's)."""
import enum

from megatron.core.enums import ModelType  # noqa: F401  (one class for both import paths)


class LayerType(enum.Enum):
    """Megatron's values; embedding/loss/mtp name entries of --pipeline-model-parallel-layout."""
    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6  # Transformer Engine's KV-cache mask; local attention refuses it


class AttnBackend(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class CudaGraphModule(enum.Enum):
    """Per-layer CUDA-graph capture regions (cuda_graph_impl 'local' / 'transformer_engine'). Only the
    'full_iteration' implementation exists here, so TransformerConfig refuses per-layer modules."""
    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


class CudaGraphScope(enum.Enum):
    """Megatron's deprecated predecessor of CudaGraphModule (kept there to unpickle old checkpoints)."""
    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8


class InferenceCudaGraphScope(enum.Enum):
    """Who owns inference CUDA graphs: none, each layer, or the block."""
    none = 1
    layer = 2
    block = 3
