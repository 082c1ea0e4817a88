"""Megatron's import path for the BERT pooler (defined with the LM head)."""
from megatron.core.models.bert.bert_lm_head import Pooler  # noqa: F401
