"""The per-iteration training log line (COMPAT.md 3.1), timers report, TensorBoard/W&B scalars."""
from datetime import datetime

import torch

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.moe.moe_logging import track_moe_metrics
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern
from megatron.training.diagnostics import energy as energy_log
from megatron.training.flops import current_device_name, format_throughput_line, num_floating_point_operations
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers, get_wandb_writer
from megatron.training.theoretical_memory_usage import report_theoretical_memory
from megatron.training.utils import print_rank_last, report_memory

ADVANCED = "advanced iterations"
SKIPPED = "skipped iterations"
NAN = "nan iterations"
_COUNTERS = (ADVANCED, SKIPPED, NAN)

# Timers printed at each log interval (levels filter which exist). Megatron's list, plus the waits of the
# overlapped interleaved p2p (where its exposed time shows; the send-recv timers there time the posting).
TIMERS_TO_LOG = [
    "forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv",
    "forward-send", "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "forward-send-forward-recv-wait", "backward-send-backward-recv-wait",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
]


def accumulate(total_loss_dict, loss_dict, skipped_iter):
    """Add this iteration's losses to the window; count skipped and NaN iterations."""
    for key in _COUNTERS:
        total_loss_dict.setdefault(key, 0)
    total_loss_dict[ADVANCED] += 0 if skipped_iter else 1
    total_loss_dict[SKIPPED] += skipped_iter
    got_nan = False
    for key, value in loss_dict.items():
        if not skipped_iter:
            # Summed where the loss lives: read back only at log points, so steps run without a host sync.
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value.detach().float()
        else:
            v = float(value.float().sum().item())
            got_nan = got_nan or v != v or v in (float("inf"), float("-inf"))
    total_loss_dict[NAN] += int(got_nan)


def format_log_line(args, iteration, elapsed_per_iter, learning_rate, batch_size, total_loss_dict, loss_scale,
                    grad_norm, num_zeros, params_norm, throughput=None, max_attention_logit=None, energy=None):
    """Megatron's line: fields in order, each followed by ' |'. ``max_attention_logit``
    (--log-max-attention-logit, this iteration's) follows the params norm; Megatron writes it to TensorBoard
    and W&B only. ``energy``: (J per iteration per GPU, W per GPU) under --log-energy."""
    s = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, args.train_iters)
    s += " consumed samples: {:12d} |".format(args.consumed_train_samples)
    if getattr(args, "skipped_train_samples", 0) > 0:  # getattr: log parsers' tests pass partial namespaces
        s += " skipped samples: {:12d} |".format(args.skipped_train_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_per_iter * 1000.0)
    if throughput is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    if energy is not None:
        s += f" energy per GPU (J/iter/GPU): {energy[0]:.1f} |"
        s += f" power per GPU (W/GPU): {energy[1]:.1f} |"
    s += f" learning rate: {learning_rate:.6E} |"
    s += " global batch size: {:5d} |".format(batch_size)
    advanced = max(1, total_loss_dict.get(ADVANCED, 0))
    for key, value in total_loss_dict.items():
        if key in _COUNTERS:
            continue
        avg = float(value) / float(advanced)
        if avg > 0.0:
            s += " {}: {:.6E} |".format(key, avg)
    s += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        s += " grad norm: {:.3f} |".format(float(grad_norm))
    if num_zeros is not None:
        s += " num zeros: {} |".format(int(num_zeros))
    if params_norm is not None:
        s += " params norm: {:.3f} |".format(params_norm)
    if max_attention_logit is not None:
        s += " max attention logit: {:.3f} |".format(max_attention_logit)
    s += " number of skipped iterations: {:3d} |".format(total_loss_dict.get(SKIPPED, 0))
    s += " number of nan iterations: {:3d} |".format(total_loss_dict.get(NAN, 0))
    return s


def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                 skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit=None):
    """Accumulate, and at log points print the line (last rank), timers and memory. Returns report flag.
    ``max_attention_logit``: this iteration's (--log-max-attention-logit), None otherwise."""
    args, timers = get_args(), get_timers()
    accumulate(total_loss_dict, loss_dict, skipped_iter)
    if getattr(args, "num_experts", None):  # getattr: the throughput tests drive this with a partial namespace
        _track_moe(args, iteration, total_loss_dict)
    batch_size = args.micro_batch_size * args.data_parallel_size * _num_microbatches()
    _write_scalars(args, iteration, learning_rate, batch_size, loss_dict, loss_scale, grad_norm,
                   num_zeros_in_grad, params_norm, max_attention_logit)
    if not (iteration % args.log_interval == 0 or iteration == 1):
        return report_memory_flag
    elapsed = timers("interval-time").elapsed(barrier=True)
    window = max(1, total_loss_dict[ADVANCED] + total_loss_dict[SKIPPED])
    per_iter = elapsed / window
    throughput = None
    if args.log_throughput:
        flops = num_floating_point_operations(args, batch_size)
        throughput = flops / (per_iter * 1e12 * args.world_size)
    energy = energy_log.log_fields(window, per_iter, args.world_size)  # --log-energy; a collective
    writer = get_tensorboard_writer()
    if writer is not None:
        writer.add_scalar("iteration-time", per_iter, iteration)
        if throughput is not None:
            writer.add_scalar("throughput", throughput, iteration)
        if energy is not None:  # Megatron's names
            writer.add_scalar("iter-energy/gpu", energy[0], iteration)
            writer.add_scalar("power/gpu", energy[1], iteration)
    wandb = get_wandb_writer()
    if wandb is not None:
        wandb.log({"iteration-time": per_iter}, step=iteration)
        if energy is not None:
            wandb.log({"iter-energy/gpu": energy[0], "power/gpu": energy[1]}, step=iteration)
    print_rank_last(format_log_line(args, iteration, per_iter, learning_rate, batch_size, total_loss_dict,
                                    loss_scale, grad_norm, num_zeros_in_grad, params_norm, throughput,
                                    max_attention_logit, energy))
    if throughput is not None:
        print_rank_last(format_throughput_line(batch_size * args.seq_length, per_iter, args.world_size,
                                               throughput, current_device_name()))
    for key in list(total_loss_dict):
        total_loss_dict[key] = 0 if key in _COUNTERS else 0.0
    interval = getattr(args, "log_memory_interval", None)
    again = bool(interval) and iteration % interval == 0  # --log-memory-interval: the report every N iterations
    if report_memory_flag and torch.distributed.get_rank() == 0:
        report_theoretical_memory(args)
    if (report_memory_flag or again) and parallel_state.get_data_parallel_rank() == 0 and torch.cuda.is_available():
        print(f"[Rank {torch.distributed.get_rank()}] (after {iteration} iterations) "
              + report_memory("", getattr(args, "log_device_memory_used", False)).strip(), flush=True)
    report_memory_flag = False
    timers.log(TIMERS_TO_LOG, normalizer=window)
    return report_memory_flag


def _track_moe(args, iteration, total_loss_dict):
    """MoE losses after 'lm loss' in the line (Megatron's names), expert load spread, per-layer scalars.
    Every rank joins: the values are reduced over PP, TP and DP."""
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    names = [name for kind, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                                     ("global_aux_loss", "global_load_balancing_loss")) if kind in types]
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    writer = get_tensorboard_writer() if iteration % args.tensorboard_log_interval == 0 else None
    wandb = get_wandb_writer() if iteration % args.tensorboard_log_interval == 0 else None
    track_moe_metrics(1.0 / _num_microbatches(), iteration, writer, wandb, total_loss_dict,
                      per_layer_logging=args.moe_per_layer_logging, track_names=names, num_layers=args.num_layers,
                      moe_layer_pattern=moe_layer_pattern(args.moe_layer_freq, args.num_layers))


def _num_microbatches():
    return get_num_microbatches()


def _write_scalars(args, iteration, learning_rate, batch_size, loss_dict, loss_scale, grad_norm, num_zeros,
                   params_norm, max_attention_logit=None):
    """TensorBoard (Megatron's names, each also '... vs samples') and W&B, every --tensorboard-log-interval."""
    writer, wandb = get_tensorboard_writer(), get_wandb_writer()
    if iteration % args.tensorboard_log_interval != 0:
        return
    if args.log_timers_to_tensorboard and args.tensorboard_dir is not None:
        # The max over ranks is a collective: every rank joins (only the last one holds the writer).
        get_timers().write(TIMERS_TO_LOG, writer, iteration, normalizer=1.0)
    if writer is None and wandb is None:
        return
    samples = args.consumed_train_samples
    scalars = {"learning-rate": learning_rate, "batch-size": batch_size}
    scalars.update({k: float(v) for k, v in loss_dict.items()})
    if args.log_loss_scale_to_tensorboard:
        scalars["loss-scale"] = loss_scale
    if args.log_world_size_to_tensorboard:
        scalars["world-size"] = args.world_size
    for name, value in (("grad-norm", grad_norm), ("num-zeros", num_zeros), ("params-norm", params_norm)):
        if value is not None:
            scalars[name] = float(value)
    if max_attention_logit is not None:  # Megatron's name (with an underscore, unlike the others)
        scalars["max_attention_logit"] = float(max_attention_logit)
    if args.log_memory_to_tensorboard and torch.cuda.is_available():
        scalars["mem-reserved-bytes"] = torch.cuda.memory_reserved()
        scalars["mem-allocated-bytes"] = torch.cuda.memory_allocated()
        scalars["mem-max-allocated-bytes"] = torch.cuda.max_memory_allocated()
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
            writer.add_scalar(f"{name} vs samples", value, samples)
    if wandb is not None:
        wandb.log({**scalars, "samples": samples}, step=iteration)
