"""Process-wide singletons of the training application: args, timers, tokenizer, writers.

Only `megatron/training` uses these; `megatron/core` receives configs and process groups instead.
"""
import os
import sys

from megatron.core import num_microbatches_calculator as mbc
from megatron.core.energy_monitor import EnergyMonitor
from megatron.core.errors import InputError
from megatron.core.timers import Timers
from megatron.core.utils import lazy_names
from megatron.training.exit import DistributedSignalHandler
from megatron.training.tokenizer import build_tokenizer

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None
_GLOBAL_TIMERS = None
_GLOBAL_SIGNAL_HANDLER = None
_GLOBAL_ADLR_AUTORESUME = None
_GLOBAL_ENERGY_MONITOR = None


def _ensure(var, name):
    assert var is not None, f"{name} is not initialized"
    return var


def get_args():
    return _ensure(_GLOBAL_ARGS, "args")


def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_timers():
    return _ensure(_GLOBAL_TIMERS, "timers")


def get_tokenizer():
    return _ensure(_GLOBAL_TOKENIZER, "tokenizer")


def get_tensorboard_writer():
    """TensorBoard SummaryWriter on the last rank with --tensorboard-dir, else None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    """The `wandb` module (after wandb.init) on the last rank with --wandb-project, else None."""
    return _GLOBAL_WANDB_WRITER


def get_signal_handler():
    return _GLOBAL_SIGNAL_HANDLER


def get_energy_monitor():
    """The EnergyMonitor under --log-energy (NVML opened when training starts), else None."""
    return _GLOBAL_ENERGY_MONITOR


def update_num_microbatches(consumed_samples, consistency_check=True):
    mbc.update_num_microbatches(consumed_samples, consistency_check)


def set_global_variables(args, build_tokenizer=True):
    """Create every singleton from validated args (idempotent per process: old ones are replaced)."""
    global _GLOBAL_TIMERS
    set_args(args)
    mbc.unset_num_microbatches_calculator()
    # Megatron's training passes the sequence length, so a step schedule's thresholds count tokens.
    mbc.init_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size, args.decrease_batch_size_if_needed,
        step_batch_size_schedule=args.step_batch_size_schedule, seq_length=args.seq_length)
    if build_tokenizer:
        _build_tokenizer(args)
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)
    _set_tensorboard_writer(args)
    _set_wandb_writer(args)
    if args.exit_signal_handler:
        _set_signal_handler(args.exit_signal)
    _set_adlr_autoresume(args)
    _set_energy_monitor(args)


def _set_energy_monitor(args):
    global _GLOBAL_ENERGY_MONITOR
    _GLOBAL_ENERGY_MONITOR = EnergyMonitor() if getattr(args, "log_energy", False) else None


def _set_adlr_autoresume(args):
    """--adlr-autoresume: the cluster's ``userlib.auto_resume.AutoResume``, imported from the
    directory named by $SUBMIT_SCRIPTS (default: the working directory), as Megatron finds it."""
    global _GLOBAL_ADLR_AUTORESUME
    _GLOBAL_ADLR_AUTORESUME = None
    if not args.adlr_autoresume:
        return
    path = os.environ.get("SUBMIT_SCRIPTS", ".")
    if path not in sys.path:
        sys.path.append(path)
    try:
        from userlib.auto_resume import AutoResume  # lazy: found only on $SUBMIT_SCRIPTS, put on sys.path above
    except ImportError as e:
        raise InputError(f"--adlr-autoresume: cannot import userlib.auto_resume.AutoResume from SUBMIT_SCRIPTS="
                         f"{path} ({e}); point SUBMIT_SCRIPTS at the directory holding userlib/ or drop the flag")
    _GLOBAL_ADLR_AUTORESUME = AutoResume


def _build_tokenizer(args):
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def _set_tensorboard_writer(args):
    global _GLOBAL_TENSORBOARD_WRITER
    _GLOBAL_TENSORBOARD_WRITER = None
    if args.tensorboard_dir and args.rank == args.world_size - 1:
        from torch.utils.tensorboard import SummaryWriter  # lazy: ~0.5 s to import, only with --tensorboard-dir
        print("> setting tensorboard ...", flush=True)
        _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir,
                                                   max_queue=args.tensorboard_queue_size)


def _set_wandb_writer(args):
    """W&B run on the last rank; WANDB_MODE=offline keeps it local."""
    global _GLOBAL_WANDB_WRITER
    _GLOBAL_WANDB_WRITER = None
    if not args.wandb_project or args.rank != args.world_size - 1:
        return
    import wandb  # lazy: ~0.9 s to import, only with --wandb-project
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None, dir=save_dir,
               entity=args.wandb_entity or None, config=_wandb_config(args))
    _GLOBAL_WANDB_WRITER = wandb


def _wandb_config(args):
    return {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v))
            for k, v in vars(args).items()}


def _set_signal_handler(signal_name):
    global _GLOBAL_SIGNAL_HANDLER
    _GLOBAL_SIGNAL_HANDLER = DistributedSignalHandler(signal_name).__enter__()


def destroy_global_vars():
    """Forget every singleton (tests run several trainings in one process)."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER
    global _GLOBAL_TIMERS, _GLOBAL_SIGNAL_HANDLER, _GLOBAL_ADLR_AUTORESUME, _GLOBAL_ENERGY_MONITOR
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_WANDB_WRITER is not None:
        _GLOBAL_WANDB_WRITER.finish()
    if _GLOBAL_SIGNAL_HANDLER is not None:
        _GLOBAL_SIGNAL_HANDLER.release()
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_WANDB_WRITER = None
    if _GLOBAL_ENERGY_MONITOR is not None:
        _GLOBAL_ENERGY_MONITOR.shutdown()
    _GLOBAL_TIMERS = _GLOBAL_SIGNAL_HANDLER = _GLOBAL_ADLR_AUTORESUME = _GLOBAL_ENERGY_MONITOR = None
    mbc.unset_num_microbatches_calculator()


def rebuild_tokenizer(args):
    """Build the tokenizer again from args (e.g. after the vocabulary flags changed)."""
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
    _build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def get_adlr_autoresume():
    """The AutoResume class under --adlr-autoresume, else None."""
    return _GLOBAL_ADLR_AUTORESUME


# Megatron's other global_vars names (fixed answers, aliases): resolved from the compat room on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.training._compat.global_vars" for name in (
    "get_one_logger", "unset_global_variables", "get_num_microbatches",
    "get_current_global_batch_size")})
