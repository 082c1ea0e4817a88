"""The end of a step under --defer-embedding-wgrad-compute: the last stage's parked output-layer GEMMs.

During the step the output layer's backward returned only its input gradient and parked each weight-gradient
GEMM's operands in the layer's buffers (tensor_parallel.layers._LinearWithDeferredWgrad), so the last stage
sent every input gradient upstream one GEMM sooner. After its last backward the stage runs them here, while
the earlier stages still work through their own flush, then reports the weight's gradient to DDP: its
bucket's reduction (with --overlap-grad-reduce) starts only once these GEMMs are in main_grad.
"""
from megatron.core.tensor_parallel.weight_grad import drain_embedding_wgrad_compute, main_grad_placeholder
from megatron.core.transformer.moe.delayed_wgrad import accumulate_param_grad
from megatron.core.utils import get_attr_wrapped_model


def _deferring_output_layers(config, model_chunks):
    """(module, output layer) of every chunk on this rank whose output layer parks its GEMMs (none when the
    config does not defer)."""
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return
    for chunk in model_chunks:
        try:
            module = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
        except RuntimeError:  # a model without pipeline stages' post_process holds no output layer to drain
            continue
        layer = getattr(module, "output_layer", None) if getattr(module, "post_process", False) else None
        if layer is not None and layer.grad_output_buffer is not None:
            yield module, layer


def drop_parked_output_wgrad(config, model_chunks) -> None:
    """Empty the parking buffers: at the start of every schedule call (what an earlier call left there, e.g. a
    forward-only pass run with autograd on, or a step that raised, is no part of this step) and after a
    forward-only call, whose parked inputs get no backward."""
    for _, layer in _deferring_output_layers(config, model_chunks):
        layer.embedding_activation_buffer.clear()
        layer.grad_output_buffer.clear()


def finish_deferred_output_wgrad(config, model_chunks) -> None:
    """Run every parked output-layer weight-gradient GEMM of this step on this rank (none when the config does
    not defer or this rank holds no output layer) and report the output weight's gradient ready."""
    for module, layer in _deferring_output_layers(config, model_chunks):
        weight = (module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights
                  else layer.weight)
        if not weight.requires_grad:
            continue
        drain_embedding_wgrad_compute(config, layer.embedding_activation_buffer, layer.grad_output_buffer, weight,
                                      layer.tp_group)
        # DDP's hook skips the placeholder (the gradient is already in main_grad) and marks the bucket ready.
        accumulate_param_grad(weight, main_grad_placeholder(weight))
        weight.grad = None  # no hook consumed it (a model without DDP's hooks): main_grad is the gradient
