"""Megatron Core's T5 mask and position helpers that T5Model here does not call (it builds both itself).
Reached from ``megatron.core.models.T5.t5_model`` through its lazy alias table.
"""
import torch

from megatron.core.models.common.language_module.language_module import LanguageModule


def t5_extended_attention_mask(attention_mask_list):
    """[b, sq, sk] masks -> [b, 1, sq, sk] (one head axis, broadcast over heads); None stays None."""
    return [None if m is None else m.unsqueeze(1) for m in attention_mask_list]


def t5_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] token ids -> [b, s] positions 0..s-1 (what T5Model uses when given none)."""
    return LanguageModule.default_position_ids(token_ids)
