"""Megatron Core's public per-step helpers of ``pipeline_parallel.schedules`` that the schedules here do
not call, for code that builds its own schedule: one forward step and its loss, the interleaved table,
warm-up counts, boundary shapes, the deferred embedding wgrad, a multi-module backward. Reached from
``megatron.core.pipeline_parallel.schedules`` through its lazy alias table; the schedules themselves run
``pipeline_parallel/step.py``.
"""
from typing import Dict, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.step import RunState, apply_loss, phase_timer, set_moe_aux_loss_scale
from megatron.core.pipeline_parallel.utils import current_device, custom_backward
from megatron.core.tensor_parallel.weight_grad import drain_embedding_wgrad_compute
from megatron.core.utils import get_attr_wrapped_model


def _state(config, num_microbatches, forward_data_store, collect_non_loss_data):
    state = RunState(config, num_microbatches, forward_only=collect_non_loss_data,
                      collect_non_loss_data=collect_non_loss_data)
    state.forward_data_store = forward_data_store  # results land in the caller's list
    return state


def forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
                           num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None):
    """On the last stage, turn a forward step's output into the loss backward starts from (divided by
    its token count and the micro-batch count unless config.calculate_per_token_loss) and append the
    loss dict (or, with `collect_non_loss_data`, loss_func(output, non_loss_data=True)) to
    `forward_data_store`. Returns (output_tensor, num_tokens); other stages pass the output through.
    Without `is_last_stage`, parallel_state decides. The CP size comes from config.context_parallel_size
    (`cp_group_size` is accepted for Megatron's signature)."""
    model_vp_stage = getattr(model, "vp_stage", None)
    if vp_stage is not None and model_vp_stage is not None and vp_stage != model_vp_stage:
        raise ValueError(f"forward_step_calc_loss: vp_stage {vp_stage} is not the model's ({model_vp_stage})")
    if is_last_stage is None:
        if cp_group_size is not None:
            raise ValueError("forward_step_calc_loss: pass is_last_stage together with cp_group_size")
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        state = _state(config, num_microbatches, forward_data_store, collect_non_loss_data)
        output_tensor = apply_loss(loss_func, output_tensor, state)
        num_tokens = state.total_num_tokens.cpu()
    if getattr(config, "num_moe_experts", None):
        set_moe_aux_loss_scale(config, _state(config, num_microbatches, [], collect_non_loss_data))
    return output_tensor, num_tokens


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                 config, cp_group_size, collect_non_loss_data=False, checkpoint_activations_microbatch=None,
                 is_first_microbatch=False, current_microbatch=None, vp_stage=None, is_last_stage=True):
    """One micro-batch through one model chunk: set its input tensor, call
    forward_step_func(data_iterator, model[, checkpoint_activations_microbatch]), then
    forward_step_calc_loss. Returns (output, num_tokens); output is a list when `input_tensor` is one.
    `current_microbatch` (the index Megatron's FP8 / CUDA-graph layers read) has no effect here."""
    timer = phase_timer(config, "forward-compute")
    timer.start()
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    as_list = isinstance(input_tensor, list)
    inputs = input_tensor if as_list else [input_tensor]
    get_attr_wrapped_model(model, "set_input_tensor")(inputs[0] if len(inputs) == 1 else inputs)
    autocast = torch.autocast(current_device().type, dtype=config.autocast_dtype) \
        if getattr(config, "enable_autocast", False) else torch.autocast("cpu", enabled=False)
    with autocast:
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)
    timer.stop()
    output_tensor, num_tokens = forward_step_calc_loss(
        model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data, num_microbatches,
        forward_data_store, cp_group_size, is_last_stage)
    return ([output_tensor] if as_list else output_tensor), num_tokens


def check_first_val_step(first_val_step, forward_only, cond):
    """`cond`, and'ed with first_val_step when validating (forward_only) and first_val_step is given."""
    return first_val_step and cond if first_val_step is not None and forward_only else cond


def get_tensor_device(tensor: Union[torch.Tensor, Dict[str, torch.Tensor]]):
    """Device of a tensor, or of the first tensor of a dict."""
    return next(iter(tensor.values())).device if isinstance(tensor, dict) else tensor.device


def get_schedule_table(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage):
    """Forward order of the interleaved schedule as (microbatch_id, model_chunk_id): groups of
    `microbatch_group_size_per_vp_stage` micro-batches, each run through chunk 0, 1, ...; a short
    last group takes the remaining micro-batches."""
    table, group = [], microbatch_group_size_per_vp_stage
    for start in range(0, num_microbatches, group):
        end = min(start + group, num_microbatches)
        table += [(m, c) for c in range(num_model_chunks) for m in range(start, end)]
    return table


def get_pp_rank_microbatches(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage,
                             forward_only=False, overlap_moe_expert_parallel_comm=False, p2p_communicator=None):
    """(total, all_in_warmup, num_warmup, num_remaining) micro-batch steps of this pipeline rank:
    1F1B warms up with PP - rank - 1 forwards; interleaved with 2 (PP - rank - 1) + (chunks - 1) x group."""
    if p2p_communicator is not None:
        pp, rank = p2p_communicator.pp_group.size(), p2p_communicator.pp_group.rank()
        vp = getattr(p2p_communicator, "virtual_pipeline_model_parallel_size",
                     parallel_state.get_virtual_pipeline_model_parallel_world_size())
    else:
        pp, rank = (parallel_state.get_pipeline_model_parallel_world_size(),
                    parallel_state.get_pipeline_model_parallel_rank())
        vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp > 1 and vp is None:
        warmup = pp - rank - 1
    elif pp > 1:
        warmup = 2 * (pp - rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
        warmup += int(bool(overlap_moe_expert_parallel_comm))
    else:
        warmup = 0
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_warmup, warmup, total - warmup


def get_tensor_shapes(*, seq_length: int, micro_batch_size: int, decoder_seq_length: int, config,
                      tp_group: Optional[torch.distributed.ProcessGroup] = None,
                      cp_group: Optional[torch.distributed.ProcessGroup] = None):
    """[(s / CP (/ TP with sequence parallelism), b, h)] crossing a stage boundary, or [()] with
    config.variable_seq_lengths. Groups default to parallel_state's."""
    if getattr(config, "variable_seq_lengths", False):
        return [()]
    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    cp = cp_group.size() if cp_group is not None else parallel_state.get_context_parallel_world_size()
    seq //= cp
    if config.sequence_parallel:
        seq //= tp_group.size() if tp_group is not None else parallel_state.get_tensor_model_parallel_world_size()
    return [(seq, micro_batch_size, config.hidden_size)]


def clear_embedding_activation_buffer(config, model, is_last_stage):
    """With config.defer_embedding_wgrad_compute on the last stage: empty the output layer's buffer of
    activations and return the module holding it; else None."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return None
    module = get_attr_wrapped_model(model[-1] if isinstance(model, list) else model, "post_process",
                                    return_model_obj=True)
    module.embedding_activation_buffer.clear()
    module.grad_output_buffer.clear()  # the two lists pair by index (tensor_parallel.layers)
    return module


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, tp_group):
    """With config.defer_embedding_wgrad_compute on the last stage: run the buffered output-layer weight
    gradient GEMMs (megatron.core.tensor_parallel.weight_grad.drain_embedding_wgrad_compute)."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return
    weight = embedding_module.shared_embedding_or_output_weight() \
        if embedding_module.share_embeddings_and_output_weights else embedding_module.output_layer.weight
    drain_embedding_wgrad_compute(config, embedding_module.embedding_activation_buffer,
                                  embedding_module.grad_output_buffer, weight, tp_group)


def backward_step_multimodule(input_tensor, output_tensor, output_tensor_grad, config, language_model_module_name):
    """backward_step over {module name: tensor} dicts (a stage holding several modules, e.g. an encoder
    and a language model). On the last stage `output_tensor` is the language model's loss alone (fp16
    loss-scaled); modules without an output that needs grad are skipped. Returns {name: input grad}."""
    single = lambda t: t[0] if isinstance(t, list) else t  # noqa: E731
    for tensor in input_tensor.values():
        if single(tensor) is not None:
            single(tensor).retain_grad()
    if not isinstance(output_tensor, dict):
        output_tensor = {language_model_module_name: output_tensor}
    output_tensor_grad = output_tensor_grad or {name: None for name in output_tensor}
    for name in output_tensor:
        out, grad = single(output_tensor[name]), single(output_tensor_grad[name])
        if grad is None and getattr(config, "grad_scale_func", None) is not None:
            out = config.grad_scale_func(out)
        if out is None or not out.requires_grad:
            continue
        if getattr(config, "deallocate_pipeline_outputs", False):
            custom_backward(out, grad)
        else:
            torch.autograd.backward(out, grad_tensors=grad)
    return {name: None if single(t) is None else single(t).grad for name, t in input_tensor.items()}
