"""Megatron Core's ``finalize_model_grads.reset_model_temporary_tensors``, which the training loop here does
not call. Reached from ``megatron.core.distributed.finalize_model_grads`` through its lazy alias table.
"""
from typing import List

import torch

from megatron.core.distributed.finalize_model_grads import _unwrap


def reset_model_temporary_tensors(config, model: List[torch.nn.Module]):
    """Forget the per-step MoE router statistics (token counts behind the expert-bias update and the
    global-batch aux loss), e.g. after a skipped iteration, so the next step starts from zero."""
    for chunk in model:
        for module in _unwrap(chunk).modules():
            if getattr(config, "moe_router_enable_expert_bias", False) and \
                    getattr(module, "local_tokens_per_expert", None) is not None:
                module.local_tokens_per_expert.zero_()
            if getattr(module, "global_tokens_per_expert", None) is not None:
                module.global_tokens_per_expert.zero_()
                module.ga_steps = 0
