"""residual + dropout(x + bias), Megatron's bias-dropout-add ("bda") factories.

There is no separate fused kernel here: the "fused" variants run the same eager expression, which
torch.compile fuses when the layer is compiled (--bias-dropout-fusion has no other effect)."""
from typing import Optional, Tuple

import torch


def _bias_dropout_add(x_with_bias, residual, prob: float, training: bool):
    """residual + dropout(x + bias)."""
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    return residual + torch.nn.functional.dropout(x, p=prob, training=training)


def bias_dropout_add_unfused(training):
    """bda(x_with_bias, residual, prob) with dropout active when `training`."""
    def bda(x_with_bias, residual, prob):
        return _bias_dropout_add(x_with_bias, residual, prob, training)
    return bda


def bias_dropout_add_fused_train(x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
                                 residual: torch.Tensor, prob: float) -> torch.Tensor:
    return _bias_dropout_add(x_with_bias, residual, prob, True)


def bias_dropout_add_fused_inference(x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
                                     residual: torch.Tensor, prob: float) -> torch.Tensor:
    return _bias_dropout_add(x_with_bias, residual, prob, False)


def get_bias_dropout_add(training, fused):
    """The bda function for a layer: train/inference variant when `fused`, else a closure."""
    if fused:
        return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)
