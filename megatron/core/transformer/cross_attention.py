"""Cross-attention (T5 decoder) lives in megatron/core/transformer/attention.py, beside self-attention and
their shared base, as in Megatron; this path keeps working."""
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules  # noqa: F401
