"""Embedding weight-gradient GEMMs run after the pipeline drain (Megatron's
--defer-embedding-wgrad-compute helpers; re-exported by megatron/core/utils.py). The helpers work on
any (activation, output-gradient) buffers given to them; our output layer computes its weight
gradient in its own backward, so the training loop does not defer it."""
import torch

__all__ = ["prepare_input_tensors_for_wgrad_compute", "drain_embedding_wgrad_compute"]


def prepare_input_tensors_for_wgrad_compute(grad_output, all_gathered_input):
    """Contiguous 2-D views ([s*b, out], [s*b, in]) of a [s, b, *] output gradient and input."""
    grad_output, all_gathered_input = grad_output.contiguous(), all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[-1])
        all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[-1])
    return grad_output, all_gathered_input


def drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group):
    """weight.main_grad += sum_i g_i^T x_i over the buffered micro-batches, emptying both buffers.
    Under config.sequence_parallel each x_i is this rank's sequence chunk and is all-gathered over
    `tp_group` first."""
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise ValueError("drain_embedding_wgrad_compute: activation and gradient buffers differ in length")
    if not hasattr(weight, "main_grad"):
        raise ValueError("drain_embedding_wgrad_compute: the weight has no main_grad (wrap the model in "
                         "DistributedDataParallel with gradient_accumulation_fusion)")
    from megatron.core.tensor_parallel.layers import _accumulate_weight_grad
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim
    while embedding_activation_buffer:
        x = embedding_activation_buffer.pop(0)
        if config.sequence_parallel:
            x = _gather_along_first_dim(x, tp_group)
        g2d, x2d = prepare_input_tensors_for_wgrad_compute(grad_output_buffer.pop(0), x)
        _accumulate_weight_grad(weight.main_grad, g2d, x2d)
