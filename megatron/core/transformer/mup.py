"""Maximal Update Parameterization (MuP; Yang et al.), Megatron's ``use_mup``: hyperparameters tuned on a narrow
base model (``mup_base_hidden_size``) transfer to a wider one, hidden size h, width multiplier m = h / base.

What changes with width (Megatron 0.19's rules, all computed once in the config):
- attention scores scale as 1/d (``mup_attn_scale_power`` 1) instead of 1/sqrt(d), times sqrt(``mup_base_head_dim``)
  when given, so that the base model's head size keeps its usual scale (an explicit ``softmax_scale`` wins);
- the logits are multiplied by ``mup_output_mult`` (default 1/m), the embeddings by ``mup_embedding_mult``;
- hidden weights start at std / sqrt(m), residual-branch output projections at std / sqrt(2 L m); embeddings (and
  an untied output layer) keep the base std;
- Adam's LR and eps of hidden matrices are divided by m (the optimizer's overrides, optimizer/config_overrides.py).
"""
import math

from megatron.core.utils import init_method_normal


def check_mup(config) -> None:
    """ValueError naming the flag for what MuP cannot take. ``config``: a TransformerConfig, or the parsed flags
    (the same attribute names), so the flags and the library refuse in the same words."""
    if config.mup_width_mult != 1.0:
        raise ValueError("--mup-width-mult is computed as --hidden-size / --mup-base-hidden-size: pass "
                         "--mup-base-hidden-size instead")
    if not config.use_mup:
        return
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("--use-mup is not supported with multi-latent attention (its softmax scale has its own "
                         "YaRN factor)")
    if config.mup_base_hidden_size is not None and config.mup_base_hidden_size <= 0:
        raise ValueError(f"--mup-base-hidden-size must be positive, got {config.mup_base_hidden_size}")


def apply_mup(config) -> None:
    """Fill the MuP-derived fields of ``config`` (a TransformerConfig with use_mup) before its init methods."""
    check_mup(config)
    if config.mup_base_hidden_size is None:
        config.mup_base_hidden_size = config.hidden_size
    config.mup_width_mult = config.hidden_size / config.mup_base_hidden_size
    if config.softmax_scale is None:
        base = 1.0 if config.mup_base_head_dim is None else math.sqrt(config.mup_base_head_dim)
        config.softmax_scale = base / config.kv_channels ** config.mup_attn_scale_power
    if config.mup_output_mult == 1.0 and config.mup_width_mult != 1.0:
        config.mup_output_mult = 1.0 / config.mup_width_mult
    m = config.mup_width_mult
    if config.embedding_init_method_std is None:
        config.embedding_init_method_std = config.init_method_std
    if config.embedding_init_method is None:  # the embeddings keep the base std
        config.embedding_init_method = init_method_normal(config.embedding_init_method_std)
    if config.init_method is None:
        config.init_method = init_method_normal(config.init_method_std / math.sqrt(m))
    if config.output_layer_init_method is None:
        depth = 1.0 if config.is_hybrid_model else 2.0
        config.output_layer_init_method = init_method_normal(
            config.init_method_std / (math.sqrt(depth * config.num_layers) * math.sqrt(m)))


def scale_logits(config, logits):
    """The logits times ``mup_output_mult`` under MuP (unchanged otherwise or at 1)."""
    mult = config.mup_output_mult if getattr(config, "use_mup", False) else 1.0
    return logits if mult == 1.0 else logits * mult


def scale_embeddings(config, embeddings):
    """The embeddings times ``mup_embedding_mult`` under MuP (unchanged otherwise or at 1)."""
    mult = config.mup_embedding_mult if getattr(config, "use_mup", False) else 1.0
    return embeddings if mult == 1.0 else embeddings * mult
