"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, and interleaved 1F1B.

The schedule owns micro-batching and stage-to-stage communication; the model and the training loop
plug in through ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`` and the
hooks on the model config (``no_sync_func``, ``finalize_model_grads_func``, ``grad_scale_func``,
``grad_sync_func``, ``param_sync_func``, ``timers``).
"""
from collections import deque
from functools import lru_cache
from typing import Iterator, List, Optional, Union

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import combined_1f1b, step
from megatron.core.pipeline_parallel.deferred_output_wgrad import (
    drop_parked_output_wgrad,
    finish_deferred_output_wgrad,
)
from megatron.core.pipeline_parallel.interleaved import run_interleaved
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, default_communicator, get_tensor_shape
from megatron.core.pipeline_parallel.utils import deallocate_output_tensor, make_plan
from megatron.core.process_groups_config import get_pg, get_pg_size
from megatron.core.utils import get_model_config, lazy_names

_COMPAT = "megatron.core._compat.schedules"
# Megatron's schedules path for the per-step pieces defined in step.py / utils.py, and for its public
# per-step helpers that the schedules here do not call (the _compat room), resolved on first use.
__getattr__ = lazy_names(__name__, {
    "backward_step": "megatron.core.pipeline_parallel.step",
    "custom_backward": "megatron.core.pipeline_parallel.utils",
    "forward_step": _COMPAT, "forward_step_calc_loss": _COMPAT, "backward_step_multimodule": _COMPAT,
    "check_first_val_step": _COMPAT, "get_tensor_device": _COMPAT, "get_schedule_table": _COMPAT,
    "get_pp_rank_microbatches": _COMPAT, "get_tensor_shapes": _COMPAT,
    "clear_embedding_activation_buffer": _COMPAT, "finish_embedding_wgrad_compute": _COMPAT,
})


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None,
                              schedule_pg_collection=None):
    """The schedule for the layout: PP=1, PP>1, or PP>1 with virtual stages. `pp_size`/`vp_size`
    override parallel_state's sizes; so does the `pp` group of an explicit `schedule_pg_collection`
    (hand the collection to the schedule too, as `pg_collection`)."""
    if pp_size is None and schedule_pg_collection is not None:
        pp_size = get_pg_size(schedule_pg_collection, "pp", "get_forward_backward_func")
    pp = pp_size if pp_size is not None else parallel_state.get_pipeline_model_parallel_world_size()
    vp = vp_size if vp_size is not None else parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp > 1:
        if vp is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def _refuse_force_all_reduce(force_all_reduce=False):
    """Forced all-reduce (instead of the distributed optimizer's reduce-scatter) is not implemented."""
    if force_all_reduce:
        raise NotImplementedError("pipeline schedules: force_all_reduce=True is not supported; leave it False")


def _communicator(p2p_communicator, pg_collection, config) -> P2PCommunicator:
    """The given communicator, else one on the explicit collection's pp group, else parallel_state's."""
    if p2p_communicator is not None:
        return p2p_communicator
    if pg_collection is not None:
        return P2PCommunicator(get_pg(pg_collection, "pp", "forward_backward_func"), config)
    return default_communicator(config)


# ---- shared helpers --------------------------------------------------------------------------------

def _finish(config, model_chunks, state: step.RunState, timer):
    if not state.forward_only:
        finish_deferred_output_wgrad(config, model_chunks)  # --defer-embedding-wgrad-compute's parked GEMMs
    else:
        drop_parked_output_wgrad(config, model_chunks)  # a forward-only pass with autograd on parks inputs too
    timer.stop()
    if not state.forward_only and getattr(config, "finalize_model_grads_func", None) is not None:
        per_token = getattr(config, "calculate_per_token_loss", False)
        # The explicit groups go on to finalize_model_grads (a default run calls it as it always has).
        groups = {} if state.pg_collection is None else {"pg_collection": state.pg_collection}
        config.finalize_model_grads_func(model_chunks, state.total_num_tokens if per_token else None, **groups)
    return state.forward_data_store


def _refuse_ep_overlap(config):
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise NotImplementedError("--overlap-moe-expert-parallel-comm runs in the schedule without pipelining "
                                  "only; drop it or --pipeline-model-parallel-size")


def _check_common(model, data_iterator):
    """Model chunks and one data iterator per chunk (None, as on middle stages, is shared)."""
    models, iterators = step.as_list(model), step.as_list(data_iterator)
    if len(iterators) == 1 and len(models) > 1 and iterators[0] is None:
        iterators = iterators * len(models)
    if len(iterators) != len(models):
        raise ValueError(f"data_iterator: got {len(iterators)} iterators for {len(models)} model "
                         "chunks; pass a list with one iterator per virtual pipeline stage")
    return models, iterators


# ---- no pipelining ---------------------------------------------------------------------------------

def forward_backward_no_pipelining(*, forward_step_func, data_iterator: Union[Iterator, List],
                                   model, num_microbatches: int, seq_length: int = None,
                                   micro_batch_size: int = None, decoder_seq_length: int = None,
                                   forward_only: bool = False, collect_non_loss_data: bool = False,
                                   first_val_step: bool = None, adjust_tensor_shapes_fn=None,
                                   p2p_communicator=None, pg_collection=None, force_all_reduce: bool = False):
    """Gradient accumulation over micro-batches on a single stage (PP=1).

    ``first_val_step`` only matters for FP8 weight caching, which this build does not have.
    ``pg_collection``: explicit groups (cp for the token count, and handed to finalize_model_grads_func).
    """
    _refuse_force_all_reduce(force_all_reduce)
    models, iterators = _check_common(model, data_iterator)
    if len(models) != 1:
        raise ValueError("forward_backward_no_pipelining takes one model chunk; set "
                         "--num-layers-per-virtual-pipeline-stage only with PP > 1")
    model, data_iterator = models[0], iterators[0]
    config = get_model_config(model)
    timer = step.phase_timer(config, "forward-backward", log_level=1)
    timer.start()
    state = step.RunState(config, num_microbatches, forward_only, collect_non_loss_data, pg_collection)
    drop_parked_output_wgrad(config, models)  # nothing an earlier call parked belongs to this step
    sync = step.GradSync(config, models)
    sync.disable_all()
    if getattr(config, "overlap_moe_expert_parallel_comm", False) and not forward_only and num_microbatches > 1:
        combined_1f1b.run_overlapped(forward_step_func, data_iterator, model, state, sync)
        sync.finish()
        sync.chunk_done(0)
        return _finish(config, models, state, timer)
    for i in range(num_microbatches):
        if i == num_microbatches - 1:
            sync.enable(0)  # the last micro-batch's backward launches the grad reduction
        output = step.forward_microbatch(forward_step_func, data_iterator, model, None, state, True)
        if not forward_only:
            step.backward_step(None, output, None, config)
    sync.finish()
    if not forward_only:
        sync.chunk_done(0)
    return _finish(config, models, state, timer)


# ---- 1F1B ------------------------------------------------------------------------------------------

def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, decoder_seq_length: int = None, forward_only: bool = False,
        collect_non_loss_data: bool = False, first_val_step: bool = None,
        adjust_tensor_shapes_fn=None, p2p_communicator: Optional[P2PCommunicator] = None,
        pg_collection=None, force_all_reduce: bool = False):
    """1F1B: (PP - rank - 1) warm-up forwards, then one forward + one backward per micro-batch
    in steady state, then the remaining backwards. At most PP micro-batches are in flight.
    ``pg_collection``: explicit groups (pp for the stage-to-stage exchange unless `p2p_communicator` is
    given, cp, and handed to finalize_model_grads_func)."""
    _refuse_force_all_reduce(force_all_reduce)
    models, iterators = _check_common(model, data_iterator)
    if len(models) != 1:
        raise ValueError("non-interleaved pipeline takes one model chunk per rank; use "
                         "forward_backward_pipelining_with_interleaving for virtual stages")
    model, data_iterator = models[0], iterators[0]
    config = get_model_config(model)
    _refuse_ep_overlap(config)
    comm = _communicator(p2p_communicator, pg_collection, config)
    shape = get_tensor_shape(config, seq_length, micro_batch_size)
    recv_shape, send_shape = shape, shape
    if adjust_tensor_shapes_fn is not None:
        recv_shape, send_shape = _adjusted_shapes(adjust_tensor_shapes_fn, shape)
    timer = step.phase_timer(config, "forward-backward", log_level=1)
    timer.start()
    state = step.RunState(config, num_microbatches, forward_only, collect_non_loss_data, pg_collection)
    drop_parked_output_wgrad(config, models)  # nothing an earlier call parked belongs to this step
    sync = step.GradSync(config, models)
    sync.disable_all()
    dealloc = getattr(config, "deallocate_pipeline_outputs", False)
    last = comm.is_last_stage

    num_warmup = min(comm.world_size - comm.rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    in_flight = deque()  # (input, output) of micro-batches waiting for their backward

    def one_backward(output_grad, is_last_backward):
        inp, out = in_flight.popleft()
        if is_last_backward:
            sync.enable(0)
        return step.backward_step(inp, out, output_grad, config)

    for _ in range(num_warmup):
        inp = comm.recv_forward(recv_shape)
        out = step.forward_microbatch(forward_step_func, data_iterator, model, inp, state, last)
        comm.send_forward(out, send_shape)
        if not forward_only:
            deallocate_output_tensor(out, dealloc and not last)
            in_flight.append((inp, out))

    inp = comm.recv_forward(recv_shape) if num_steady > 0 else None
    for i in range(num_steady):
        final = i == num_steady - 1
        out = step.forward_microbatch(forward_step_func, data_iterator, model, inp, state, last)
        if forward_only:
            comm.send_forward(out, send_shape)
            inp = None if final else comm.recv_forward(recv_shape)
            continue
        out_grad = comm.send_forward_recv_backward(out, send_shape)
        deallocate_output_tensor(out, dealloc and not last)
        in_flight.append((inp, out))
        in_grad = one_backward(out_grad, final and num_warmup == 0)
        if final:
            inp = None
            comm.send_backward(in_grad, recv_shape)
        else:
            inp = comm.send_backward_recv_forward(in_grad, recv_shape)

    if not forward_only:
        for i in range(num_warmup):
            out_grad = comm.recv_backward(send_shape)
            in_grad = one_backward(out_grad, i == num_warmup - 1)
            comm.send_backward(in_grad, recv_shape)
        sync.finish()
        sync.chunk_done(0)
    else:
        sync.finish()
    return _finish(config, models, state, timer)


def _adjusted_shapes(adjust_tensor_shapes_fn, shape):
    recv, send = adjust_tensor_shapes_fn([shape], [shape])
    if len(recv) != 1 or len(send) != 1:
        raise NotImplementedError("adjust_tensor_shapes_fn: only one tensor per stage boundary "
                                  "is supported")
    return tuple(recv[0]), tuple(send[0])


# ---- interleaved 1F1B ------------------------------------------------------------------------------

def check_interleaved_microbatches(num_microbatches: int, pp_size: int, group_size: int) -> None:
    """Reject micro-batch counts the interleaved schedule cannot run, with the fix."""
    if group_size < pp_size:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage ({group_size}) must be "
                         f"at least the pipeline size ({pp_size})")
    if num_microbatches < group_size or num_microbatches % group_size:
        raise ValueError(
            f"interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"the micro-batch group size ({group_size}, default the pipeline size {pp_size}): "
            "raise --global-batch-size to a multiple of micro-batch size x data-parallel size x "
            f"{group_size}, or drop virtual pipeline stages")


@lru_cache(maxsize=64)
def _plan(pp_size, rank, num_microbatches, num_chunks, group_size, forward_only):
    return make_plan(pp_size, rank, num_microbatches, num_chunks, group_size, forward_only)


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, decoder_seq_length: int = None, forward_only: bool = False,
        collect_non_loss_data: bool = False, first_val_step: bool = None,
        adjust_tensor_shapes_fn=None, p2p_communicator: Optional[P2PCommunicator] = None,
        pg_collection=None, force_all_reduce: bool = False):
    """Interleaved 1F1B over virtual stages (``model`` is a list of chunks; chunk c on PP rank r
    is virtual stage c * PP + r). Warm-up = 2 * (PP - rank - 1) + (chunks - 1) * group_size forwards,
    groups of ``microbatch_group_size_per_vp_stage`` micro-batches go through each chunk in turn.
    ``config.overlap_p2p_comm`` overlaps the stage-to-stage exchange with compute (interleaved.py).
    ``pg_collection``: explicit groups, as for the non-interleaved schedule."""
    _refuse_force_all_reduce(force_all_reduce)
    models, iterators = _check_common(model, data_iterator)
    if adjust_tensor_shapes_fn is not None:
        raise NotImplementedError("adjust_tensor_shapes_fn is not supported by the interleaved "
                                  "schedule")
    config = get_model_config(models[0])
    _refuse_ep_overlap(config)
    comm = _communicator(p2p_communicator, pg_collection, config)
    group_size = getattr(config, "microbatch_group_size_per_vp_stage", None) or comm.world_size
    check_interleaved_microbatches(num_microbatches, comm.world_size, group_size)
    timer = step.phase_timer(config, "forward-backward", log_level=1)
    timer.start()
    state = step.RunState(config, num_microbatches, forward_only, collect_non_loss_data, pg_collection)
    drop_parked_output_wgrad(config, models)  # nothing an earlier call parked belongs to this step
    plan_of = lambda r: _plan(comm.world_size, r, num_microbatches, len(models), group_size,  # noqa: E731
                              forward_only)
    run_interleaved(forward_step_func, iterators, models, comm, plan_of, state,
                    get_tensor_shape(config, seq_length, micro_batch_size))
    return _finish(config, models, state, timer)
