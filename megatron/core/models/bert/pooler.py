"""Megatron's import path for the BERT pooler, which is defined with the LM head (bert_lm_head.py)."""
from megatron.core.utils import lazy_names

__getattr__ = lazy_names(__name__, {"Pooler": "megatron.core.models.bert.bert_lm_head"})
