"""residual + dropout(x + bias), Megatron's bias-dropout-add ("bda") factories.

With --bias-dropout-fusion (Megatron's default) the training variant with a bias and dropout 0 runs as one
compiled element-wise kernel on CUDA, as Megatron's ``jit_fuser`` fuses it: eager torch writes and re-reads
``x + bias`` before adding the residual. Without a bias (Llama-style models) there is nothing to fuse at
dropout 0; with dropout the eager ops keep torch's dropout RNG stream; the inference variant stays eager
(decode shapes change every step; each would be a new compiled graph).
Inside a compiled layer (--torch-compile) the layer's graph fuses it either way."""
from typing import Optional, Tuple

import torch

from megatron.core.fusions.compile import maybe_compile


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


@maybe_compile
def _bias_add_residual_compiled(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + (x + bias)


def bias_dropout_add_fused_train(x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
                                 residual: torch.Tensor, prob: float) -> torch.Tensor:
    """With a bias and no dropout (prob 0), one compiled kernel on CUDA. With dropout the eager ops run: their
    masks come from torch's own dropout RNG stream, which activation recompute and the layout tests replay."""
    x, bias = x_with_bias
    if bias is None or prob > 0.0:
        return _bias_dropout_add(x_with_bias, residual, prob, True)
    return _bias_add_residual_compiled(x, bias, residual)


def bias_dropout_add_fused_inference(x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
                                     residual: torch.Tensor, prob: float) -> torch.Tensor:
    return _bias_dropout_add(x_with_bias, residual, prob, False)


def get_bias_dropout_add(training, fused):
    """The bda function for a layer: train/inference variant when `fused`, else a closure."""
    if fused:
        return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)
