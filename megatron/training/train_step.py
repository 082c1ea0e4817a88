"""One optimizer step over a global batch, and reduction of the per-microbatch loss dicts."""
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.staging import wait_for_staged_copies
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.optimizer.qk_clip import clip_qk
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.global_vars import get_args, get_timers

LARGE_GRAD_FACTOR = 10.0  # Megatron's threshold: 10x the largest grad norm of the first 100 steps


def get_training_forward_backward_func():
    """The schedule for this layout, wrapped in a whole-iteration CUDA graph with
    ``--cuda-graph-impl full_iteration``. Build it once per training run: the wrapper owns the graph."""
    args = get_args()
    forward_backward_func = get_forward_backward_func()
    if args.cuda_graph_impl != "full_iteration":
        return forward_backward_func
    return FullCudaGraphWrapper(forward_backward_func, args.cuda_graph_warmup_steps)


def _losses_to_host(loss_dicts):
    """Start copying a replayed graph's losses to the host without waiting for the device; returns
    a callable that finishes the copy and returns host ``loss_dicts`` for `_check_losses_finite`."""
    entries = [(i, key, value) for i, d in enumerate(loss_dicts) for key, value in d.items()
               if torch.is_tensor(value)]
    if not entries or not entries[0][2].is_cuda:
        return lambda: loss_dicts
    flat = torch.cat([value.detach().float().reshape(-1) for _, _, value in entries])
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def finish():
        done.synchronize()  # the losses only, not the optimizer step queued after them
        out, offset = [dict() for _ in loss_dicts], 0
        for i, key, value in entries:
            out[i][key] = host[offset:offset + value.numel()].view(value.shape)
            offset += value.numel()
        return out
    return finish


def _check_losses_finite(loss_dicts):
    """--check-for-nan-in-loss-and-grad for a replayed graph: the per-micro-batch check cannot sync
    inside the capture, so it runs on the graph's loss outputs, read back while the optimizer step
    runs (the run stops here, before anything is saved)."""
    for i, loss_dict in enumerate(loss_dicts):
        for key, value in loss_dict.items():
            if torch.is_tensor(value) and not bool(torch.isfinite(value).all()):
                raise RuntimeError(f"rank {torch.distributed.get_rank()}: {key} of micro-batch {i} is "
                                   f"{value.tolist()} (NaN/Inf); lower --lr or use --bf16, or pass "
                                   "--no-check-for-nan-in-loss-and-grad")


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func=None):
    """Forward/backward over all microbatches, optimizer step, scheduler step on success.

    ``forward_backward_func`` defaults to the layout's schedule; `train()` passes the one from
    `get_training_forward_backward_func()` (which may hold a CUDA graph).
    Returns (loss_dict, skipped_iter, grad_norm, num_zeros_in_grad, max_attention_logit); loss_dict is empty
    off the last stage; max_attention_logit (the whole model's, every rank) is None without --qk-clip or
    --log-max-attention-logit.
    """
    args = get_args()
    if forward_backward_func is None:
        forward_backward_func = get_forward_backward_func()
    rerun_state_machine = get_rerun_state_machine()
    if isinstance(forward_backward_func, FullCudaGraphWrapper):
        wait_for_staged_copies()  # the replayed graph updates saved state (MoE expert biases) and cannot wait
    # Once, or twice when a validated result (loss, grad norm) was rejected: see rerun_state_machine.
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=None, forward_only=False)
        if args.check_for_large_grads:
            _validate_grad_norm(model, rerun_state_machine)
    if rerun_state_machine.should_checkpoint_and_exit()[1] or rerun_state_machine.should_skip_step():
        # train() saves and exits, or counts the iteration as skipped: the update is not applied.
        loss_dict = reduce_loss_dicts(losses_reduced) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) \
            else {}
        return loss_dict, 1, None, None, None
    pending_check = None
    if getattr(forward_backward_func, "replayed", False) and args.check_for_nan_in_loss_and_grad:
        pending_check = _losses_to_host(losses_reduced)
    timer = get_timers()("optimizer", log_level=1)  # the log line's `optimizer` timer, as in Megatron
    timer.start(barrier=args.barrier_with_L1_time)
    with torch.profiler.record_function("optimizer"):  # a named range in profiler traces (NVTX under nsys)
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        max_attention_logit = None
        if args.qk_clip or args.log_max_attention_logit:  # part of the step, as in Megatron (MuonClip)
            max_attention_logit = clip_qk(model, log_max_only=not args.qk_clip, optimizer=optimizer)
    timer.stop()
    if pending_check is not None:
        _check_losses_finite(pending_check())
    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
    skipped_iter = 0 if update_successful else 1
    if args.empty_unused_memory_level >= 1 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return reduce_loss_dicts(losses_reduced), skipped_iter, grad_norm, num_zeros_in_grad, max_attention_logit
    return {}, skipped_iter, grad_norm, num_zeros_in_grad, max_attention_logit


def _validate_grad_norm(model, rerun_state_machine):
    """--check-for-large-grads: this rank's gradient norm must be finite (fatal) and below 10x the largest
    of the first 100 steps (reported): Megatron's checks, on the reduced gradients of this rank's shard."""
    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
             for chunk in model for p in chunk.parameters()]
    norms = [torch.linalg.vector_norm(g.float()) for g in grads if g is not None]
    if not norms:
        return
    norm = torch.linalg.vector_norm(torch.stack(norms))
    rerun_state_machine.validate_result(norm, torch.isnan, "found NaN in local grad norm", fatal=True)
    rerun_state_machine.validate_result(norm, torch.isinf, "found Inf in local grad norm", fatal=True)
    rerun_state_machine.validate_result(
        norm, partial(rerun_state_machine.is_unexpectedly_large, threshold=LARGE_GRAD_FACTOR, context="grads"),
        "unexpectedly large grad norm", fatal=False)


def reduce_loss_dicts(loss_dicts):
    """{key: loss} over a global batch: token-weighted (sum/count all-reduced over DP) or mean (legacy)."""
    out = {}
    if not loss_dicts:
        return out
    for key in loss_dicts[0]:
        values = [torch.as_tensor(d[key]).detach().float().view(-1) for d in loss_dicts]
        if values[0].numel() == 2:
            total = torch.vstack(values).sum(dim=0)  # [sum, count]
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(
                with_context_parallel=True))
            out[key] = total[0] / total[1]
        else:
            out[key] = torch.cat(values).mean()
    return out
