"""Evaluation over --eval-iters global batches and the framed validation line (COMPAT.md 3.2)."""
import contextlib
import math

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers, get_wandb_writer
from megatron.training.utils import print_rank_last


@contextlib.contextmanager
def _eval_micro_batch(args):
    """args.micro_batch_size is --eval-micro-batch-size while evaluating: the entry scripts' get_batch reads it for
    the shapes of the batch broadcast to the other tensor-parallel ranks."""
    train = args.micro_batch_size
    args.micro_batch_size = getattr(args, "eval_micro_batch_size", None) or train
    try:
        yield args.micro_batch_size
    finally:
        args.micro_batch_size = train


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False,
             eval_iters=None):
    """Token-weighted average of each loss key over ``eval_iters`` (default --eval-iters) global batches of
    --eval-global-batch-size samples in micro-batches of --eval-micro-batch-size (no gradients)."""
    args, timers = get_args(), get_timers()
    timers("evaluate", log_level=0).start()
    for chunk in model:
        chunk.eval()
    totals = {}
    forward_backward_func = get_forward_backward_func()
    with torch.no_grad(), _eval_micro_batch(args) as micro_batch_size:
        eval_batch_size = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
        num_microbatches = eval_batch_size // (micro_batch_size * args.data_parallel_size)
        for _ in range(args.eval_iters if eval_iters is None else eval_iters):
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=args.seq_length,
                micro_batch_size=micro_batch_size, decoder_seq_length=None, forward_only=True)
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                _accumulate_eval(totals, loss_dicts)
            args.consumed_valid_samples += micro_batch_size * args.data_parallel_size * num_microbatches
    for chunk in model:
        chunk.train()
    timers("evaluate").stop()
    timers.log(["evaluate"])
    return {key: num / den for key, (num, den) in totals.items()}


def _accumulate_eval(totals, loss_dicts):
    for key in loss_dicts[0]:
        values = [torch.as_tensor(d[key]).detach().float().view(-1) for d in loss_dicts]
        if values[0].numel() == 2:
            pair = torch.vstack(values).sum(dim=0)  # [sum, count]
            torch.distributed.all_reduce(pair, group=parallel_state.get_data_parallel_group(
                with_context_parallel=True))
            num, den = pair[0], pair[1]
        else:
            num, den = torch.cat(values).sum(), torch.tensor(float(len(values)))
        old = totals.get(key, (torch.tensor(0.0), torch.tensor(0.0)))
        totals[key] = (old[0] + num.cpu(), old[1] + den.cpu())


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                               process_non_loss_data_func, config, verbose=False, write_to_tensorboard=True):
    """Evaluate and print ' validation loss at <prefix> | lm loss value: ... | lm loss PPL: ... | '. With
    --full-validation / --multiple-validation-sets (``data_iterator`` is a ValidationSets) each set is evaluated
    whole, one line each (' validation-<name> loss at ...', Megatron's format); returns the last set's losses."""
    sets = data_iterator if hasattr(data_iterator, "suffixes") else [("", data_iterator, None)]
    totals = {}
    for suffix, iterator, steps in sets:
        totals = evaluate(forward_step_func, iterator, model, process_non_loss_data_func, config, verbose,
                          eval_iters=steps)
        _print_losses(prefix, suffix, totals, iteration, write_to_tensorboard)
    return totals


def _print_losses(prefix, suffix, totals, iteration, write_to_tensorboard):
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None
    wandb = get_wandb_writer() if write_to_tensorboard else None
    line = f" validation{suffix} loss at {prefix} | "
    for key, value in totals.items():
        loss = float(value)
        ppl = math.exp(min(20.0, loss))
        line += f"{key} value: {loss:.6E} | {key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} validation{suffix}", loss, iteration)
            writer.add_scalar(f"{key} validation{suffix} vs samples", loss, args.consumed_train_samples)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation{suffix} ppl", ppl, iteration)
        if wandb is not None:
            wandb.log({f"{key} validation{suffix}": loss}, step=iteration)
    frame = "-" * (len(line) + 1)
    print_rank_last(frame)
    print_rank_last(line)
    print_rank_last(frame)
