"""One micro-batch through one model chunk, as every schedule runs it.

The forward step (set the chunk's input, call ``forward_step_func``, turn the last stage's output into
the loss backward starts from), the backward step, what one schedule call accumulates (``RunState``)
and the gate that holds data-parallel grad reduction back until a chunk's last backward (``GradSync``).
``schedules.py`` and ``interleaved.py`` call these through the module (``step.forward_microbatch``), so
a profiler can wrap them in one place (tools/pipeline_timeline.py does).
"""
import contextlib
from typing import Callable, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.utils import current_device, custom_backward
from megatron.core.process_groups_config import get_pg
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.utils import get_attr_wrapped_model


class _NullTimer:
    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


def phase_timer(config, name, log_level=2):
    """The config's timer ``name`` (``config.timers``), or one that does nothing."""
    timers = getattr(config, "timers", None)
    return timers(name, log_level=log_level) if timers is not None else _NullTimer()


def as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class RunState:
    """What one call of a schedule accumulates: loss dicts and the token count; and the explicit process
    groups it runs on (None: parallel_state's)."""

    def __init__(self, config, num_microbatches, forward_only, collect_non_loss_data, pg_collection=None):
        self.config = config
        self.pg_collection = pg_collection
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.forward_data_store = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=current_device())


def forward_microbatch(forward_step_func: Callable, data_iterator, model, input_tensor, state: RunState,
                  is_last_stage: bool, checkpoint_activations_microbatch=None) -> torch.Tensor:
    """Run one micro-batch through one model chunk; on the last stage turn the output into the
    (scaled) loss that backward starts from, and record its loss dict. A ``forward`` range in profiler
    traces (an NVTX range under nsys)."""
    with torch.profiler.record_function("forward"):
        return _forward_microbatch(forward_step_func, data_iterator, model, input_tensor, state, is_last_stage,
                                   checkpoint_activations_microbatch)


def _forward_microbatch(forward_step_func, data_iterator, model, input_tensor, state, is_last_stage,
                        checkpoint_activations_microbatch):
    config = state.config
    timer = phase_timer(config, "forward-compute")
    timer.start()
    get_attr_wrapped_model(model, "set_input_tensor")(input_tensor)
    autocast = contextlib.nullcontext()
    if getattr(config, "enable_autocast", False):
        autocast = torch.autocast(current_device().type, dtype=config.autocast_dtype)
    with autocast:
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)
    if is_last_stage:
        output_tensor = apply_loss(loss_func, output_tensor, state)
    if getattr(config, "num_moe_experts", None):
        set_moe_aux_loss_scale(config, state)
    timer.stop()
    return output_tensor


def set_moe_aux_loss_scale(config, state: RunState):
    """MoE auxiliary losses enter backward with the lm loss's gradient scale: the fp16 loss scale, divided
    by the micro-batch count unless the loss is summed per token."""
    scale = torch.ones(1, device=current_device())
    if getattr(config, "grad_scale_func", None) is not None:
        scale = config.grad_scale_func(scale)
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale / state.num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def apply_loss(loss_func, output_tensor, state: RunState) -> torch.Tensor:
    config = state.config
    if loss_func is None:  # no loss: the output itself is the result (Megatron's inference path)
        state.forward_data_store.append(output_tensor)
        return output_tensor
    if state.collect_non_loss_data and state.forward_only:
        state.forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor
    outputs = loss_func(output_tensor)
    if len(outputs) == 3:  # (loss_sum, num_tokens, reduced dict): token-weighted loss
        loss, num_tokens, loss_reduced = outputs
        state.total_num_tokens += torch.as_tensor(num_tokens, device=state.total_num_tokens.device,
                                                  dtype=state.total_num_tokens.dtype)
        if not getattr(config, "calculate_per_token_loss", False):
            tokens = _tokens_over_context_parallel(num_tokens, config, state.pg_collection)
            loss = loss / tokens / state.num_microbatches
    elif len(outputs) == 2:  # legacy (loss, dict): loss already averaged over the micro-batch
        loss, loss_reduced = outputs
        loss = loss * getattr(config, "context_parallel_size", 1) / state.num_microbatches
    else:
        raise ValueError("loss_func must return (loss_sum, num_tokens, dict) or (loss, dict), "
                         f"got a {len(outputs)}-tuple")
    state.forward_data_store.append(loss_reduced)
    return loss


def _tokens_over_context_parallel(num_tokens, config, pg_collection=None):
    """Token count that makes the micro-batch loss a mean over the whole sequence under CP. Each CP rank
    holds part of the tokens; DDP averages grads over DP x CP, so rank i's loss is
    sum_i / (sum of counts over CP) x CP, and the CP average is the exact token mean."""
    cp = getattr(config, "context_parallel_size", 1)
    if cp == 1:
        return num_tokens
    total = torch.as_tensor(num_tokens, device=current_device()).clone().float()
    group = parallel_state.get_context_parallel_group() if pg_collection is None else get_pg(pg_collection, "cp")
    torch.distributed.all_reduce(total, group=group)
    return total / cp


def backward_step(input_tensor, output_tensor, output_tensor_grad, config) -> Optional[torch.Tensor]:
    """Backpropagate one micro-batch through one chunk; return the grad of its input (or None). A
    ``backward`` range in profiler traces (an NVTX range under nsys)."""
    with torch.profiler.record_function("backward"):
        return _backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def _backward_step(input_tensor, output_tensor, output_tensor_grad, config) -> Optional[torch.Tensor]:
    timer = phase_timer(config, "backward-compute")
    timer.start()
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_tensor_grad is None and getattr(config, "grad_scale_func", None) is not None:
        output_tensor = config.grad_scale_func(output_tensor)  # fp16 loss scaling on the loss
    if getattr(config, "deallocate_pipeline_outputs", False):
        custom_backward(output_tensor, output_tensor_grad)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    timer.stop()
    return None if input_tensor is None else input_tensor.grad


class GradSync:
    """Keeps data-parallel grad reduction off until each chunk's last micro-batch backward."""

    def __init__(self, config, model_chunks):
        funcs = getattr(config, "no_sync_func", None)
        if funcs is None:
            funcs = [getattr(m, "no_sync", contextlib.nullcontext) for m in model_chunks]
        self.no_sync = as_list(funcs)
        self.grad_sync = getattr(config, "grad_sync_func", None)
        self.chunks = model_chunks
        self.contexts = {}

    def disable_all(self):
        for chunk, func in enumerate(self.no_sync):
            self.contexts[chunk] = func()
            self.contexts[chunk].__enter__()

    def enable(self, chunk: int):
        """Re-enable sync before ``chunk``'s last backward (one no_sync_func covers all chunks)."""
        key = chunk if len(self.no_sync) > 1 else 0
        ctx = self.contexts.pop(key, None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def chunk_done(self, chunk: int):
        if self.grad_sync is not None:
            funcs = as_list(self.grad_sync)
            funcs[chunk if len(funcs) > 1 else 0](self.chunks[chunk].parameters())

    def finish(self):
        for key in list(self.contexts):
            self.enable(key)
