"""Which params Muon takes, and the tags that route them (Megatron 0.19's layer-wise optimizer rules).

Muon takes 2-D weights other than the word embedding and output layer (`is_embedding_or_output_parameter`)
and other than params tagged `use_muon = False`; AdamW takes the rest (norms, biases, embeddings, 3-D
weights). With the layer-wise distributed optimizer (`--optimizer dist_muon`) the Muon params are tagged
before DDP wraps the model, so that DDP lays them out whole inside one DP rank's shard of a bucket.
"""
from typing import List, Optional

import torch


def is_managed_by_layer_wise_optimizer(param: torch.nn.Parameter) -> bool:
    """Megatron's routing rule: 2-D weights except the embedding and output weights go to Muon."""
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def uses_muon(param: torch.nn.Parameter) -> bool:
    """The rule above, minus params a model opted out with `param.use_muon = False` (Megatron's tag)."""
    return getattr(param, "use_muon", True) and is_managed_by_layer_wise_optimizer(param)


def tag_params_for_buffer_routing(model_chunks) -> None:
    """Tag every trainable param with `is_managed_by_layer_wise_optimizer` (before DDP builds its buffers)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad:
                param.is_managed_by_layer_wise_optimizer = uses_muon(param)


def qkv_split_shapes(config) -> List[int]:
    """Rows of q, k and v per query group in the fused QKV weight (q doubled with an output gate)."""
    kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    groups = config.num_query_groups or config.num_attention_heads
    q = config.num_attention_heads // groups * kv_channels
    if getattr(config, "attention_output_gate", False):
        return [q, q, kv_channels, kv_channels]
    return [q, kv_channels, kv_channels]


def tag_qkv_params(model_chunks) -> None:
    """Tag each fused `linear_qkv.weight` (2-D, whole query groups) with `is_qkv` and its `qkv_split_shapes`,
    which TensorParallelMuon reads with `--muon-split-qkv` (the default). Multi-latent attention has no
    fused QKV weight and is orthogonalised whole, as in Megatron."""
    for chunk in model_chunks:
        config = _model_config(chunk)
        for name, param in chunk.named_parameters():
            if not (name.endswith("linear_qkv.weight") and param.dim() == 2 and config is not None):
                continue
            shapes = qkv_split_shapes(config)
            if param.shape[0] % sum(shapes) == 0:
                param.is_qkv, param.qkv_split_shapes = True, shapes


def _model_config(chunk) -> Optional[object]:
    while not hasattr(chunk, "config") and hasattr(chunk, "module"):
        chunk = chunk.module
    config = getattr(chunk, "config", None)
    return config if hasattr(config, "num_attention_heads") else None
