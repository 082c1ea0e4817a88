"""initialize_megatron: flags, launcher environment (torchrun / SLURM / single process), device,
process groups, seeds, dataset helpers and writers."""
import atexit
import datetime
import logging
import os
import random
import re
import socket
import sys

import numpy as np
import torch

from megatron.core import num_microbatches_calculator as mbc
from megatron.core import parallel_state
from megatron.core.datasets.utils import compile_helpers
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.utils import get_pg_rank
from megatron.training.arguments import parse_args, print_args, validate_args
from megatron.training.checkpointing.args import has_checkpoint, load_args_from_checkpoint
from megatron.training.diagnostics import errors, hang
from megatron.training.global_vars import get_adlr_autoresume, get_args, get_tensorboard_writer, set_global_variables
from megatron.training.utils import print_rank_0

DEFAULT_MASTER_PORT = 29500


def _line_atomic_output():
    """Write each printed line with one system call. torchrun starts workers with `python -u`, where
    print() writes the text and the newline separately, so lines from ranks sharing a pipe interleave
    mid-line and break log parsers; line buffering joins them again."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)


def set_logging_level(level: int):
    """--logging-level: the root logger's level, and a handler that prints its records to stderr when nothing
    has installed one (Python's fallback handler prints WARNING and above only, so INFO and DEBUG records, the
    ones the flag is mostly used for, were dropped)."""
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                        allow_no_cuda=True, skip_mpu_initialization=False, parsed_args=None):
    """Parse + validate flags, set up torch.distributed and model-parallel groups, seed RNGs.

    A start-up error on any rank prints `[rank R] ArgumentError: <one line>` on that rank and every rank
    exits non-zero (2 for a bad input): see `diagnostics.errors`.
    """
    _line_atomic_output()
    setup_launcher_env()
    args = None
    try:
        args = parsed_args if parsed_args is not None else parse_args(extra_args_provider, ignore_unknown_args)
        load_and_validate_args(args, args_defaults)
        if args.rank == 0:
            print_args("arguments", args)
        set_global_variables(args)
        update_train_iters(args)
    except Exception as e:
        _fail_start(e, args)
        raise  # library mode: the caller reports it (see _fail_start)
    if args.logging_level is not None:
        set_logging_level(args.logging_level)
    _initialize_distributed(args)
    if errors.agree_on_start(False):
        print(f"[rank {args.rank}] stopping: another rank failed at start-up (its error is above)",
              file=sys.stderr, flush=True)
        errors.exit_now(2)
    if not skip_mpu_initialization:
        _initialize_model_parallel(args)
        _set_random_seed(args.seed, args.data_parallel_random_init,
                         use_cudagraphable_rng=args.cuda_graph_impl == "full_iteration")
    _compile_dataset_helpers()
    _init_autoresume()
    hang.install(args)
    return None


def load_and_validate_args(args, args_defaults):
    """Take the architecture flags from the checkpoint when --use-checkpoint-args (or the entry point's
    defaults) ask for it, then validate: the checkpoint's values are validated too. As in Megatron, the
    --pretrained-checkpoint is read first, then --load when it holds a checkpoint (a resumed fine-tune)."""
    if args.use_checkpoint_args or args_defaults.get("use_checkpoint_args", False):
        if args.pretrained_checkpoint:
            load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
        if not args.pretrained_checkpoint or (args.load and has_checkpoint(args.load)):
            load_args_from_checkpoint(args)
    validate_args(args, args_defaults)


def _init_autoresume():
    """--adlr-autoresume: start the service's clock once every rank is up."""
    autoresume = get_adlr_autoresume()
    if autoresume:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        autoresume.init()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def _fail_start(exc, args):
    """Report a start-up error on this rank, then join the default process group only to tell the other
    ranks (see `errors.agree_on_start`), so none of them waits for this one until the timeout.
    In library mode inside the caller's process group, tell the others and return: the caller re-raises,
    since exiting here would end the rank before its caller hears of the error."""
    if errors.library_mode() and torch.distributed.is_initialized():
        errors.agree_on_start(True)
        return
    errors.report(exc)
    # ``args`` is None when parsing itself failed: the getattrs below fall back to the flags' defaults.
    # Under torchrun the agent stops the other workers as soon as this one exits.
    launcher_stops_others = "TORCHELASTIC_RUN_ID" in os.environ
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized() \
            and not launcher_stops_others:
        try:
            backend = "gloo"
            if torch.cuda.is_available() and getattr(args, "distributed_backend", "nccl") == "nccl":
                backend = "nccl"
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            minutes = getattr(args, "distributed_timeout_minutes", None) or 10
            torch.distributed.init_process_group(
                backend=backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                timeout=datetime.timedelta(minutes=minutes))
            errors.agree_on_start(True)
        except Exception:  # the others still end: at their timeout, or when the launcher stops them
            pass
    errors.exit_now(errors.exit_code(exc))


def update_train_iters(args):
    """For sample-based runs: the iteration count that consumes --train-samples (walks the rampup or the step
    schedule)."""
    if args.train_samples is None:
        return
    if args.step_batch_size_schedule is not None:
        args.train_iters = sum(steps for steps, _, _ in mbc._calculator().segments(args.train_samples))
        print_rank_0(f"setting training iterations to {args.train_iters}")
        return
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
        return
    iterations, consumed = 0, 0
    while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
        mbc.update_num_microbatches(consumed, consistency_check=False)
        consumed += mbc.get_current_global_batch_size()
        iterations += 1
    mbc.update_num_microbatches(0, consistency_check=False)
    iterations += max(0, args.train_samples - consumed) // args.global_batch_size
    args.train_iters = iterations
    print_rank_0(f"setting training iterations to {args.train_iters}")


def setup_launcher_env():
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from SLURM when torchrun did not set them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        nodelist = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", ""))
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = first_host(nodelist) if nodelist else "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        return
    # One plain process: still a 1-rank process group, so every code path is the same.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def first_host(nodelist):
    """First hostname of a SLURM node list: 'node[01-04,07],gpu5' -> 'node01'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ValueError(f"cannot parse SLURM node list '{nodelist}'")
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _initialize_distributed(args):
    """Device cuda:LOCAL_RANK (or CPU) and the default process group (NCCL on CUDA, gloo on CPU)."""
    args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank % torch.cuda.device_count())
    if torch.distributed.is_initialized():
        if args.rank == 0:
            print("torch distributed is already initialized, skipping initialization ...", flush=True)
        args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return
    if args.rank == 0:
        print("> initializing torch distributed ...", flush=True)
    kwargs = dict(backend=args.distributed_backend, world_size=args.world_size, rank=args.rank,
                  timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    hang.configure_flight_recorder(args)
    if torch.cuda.is_available() and args.distributed_backend == "nccl":
        kwargs["device_id"] = torch.device(f"cuda:{torch.cuda.current_device()}")
    store = _restarted_worker_store(kwargs["timeout"])
    if store is None and args.world_size == 1:
        # One rank needs no rendezvous: an in-process store binds no port, so two single-process runs started
        # at once on one machine cannot race for the same free port (EADDRINUSE).
        store = torch.distributed.HashStore()
    if store is not None:
        kwargs["store"] = store
    with hang.WaitNotice(RENDEZVOUS_NOTICE_S, lambda: _rendezvous_text(args)):
        torch.distributed.init_process_group(**kwargs)
    atexit.register(_shutdown_distributed)


# A rendezvous of healthy ranks on one machine or a cluster completes in seconds; after this long one line per
# rank says what it waits for (see _rendezvous_text).
RENDEZVOUS_NOTICE_S = 60.0


def _rendezvous_text(args) -> str:
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    return (f"rank {args.rank} of {args.world_size} in torch.distributed's rendezvous at {addr}:{port} "
            f"(--distributed-backend {args.distributed_backend}); it completes when every rank has started with "
            "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE and can reach that address (check the launcher's "
            "other ranks and nodes, and that no other job holds the port)")


def _restarted_worker_store(timeout):
    """A key namespace of its own for a worker group that torchrun restarted (--max-restarts), else None.
    torchrun's static rendezvous (--master-addr/--master-port) hands every restart the same store and key
    prefix, so a restarted rank would read the previous launch's addresses (gloo: "Connection refused";
    NCCL: a stale unique id). The restart count names this launch's keys."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                             int(os.environ["WORLD_SIZE"]), False, timeout=timeout)
    return torch.distributed.PrefixStore(f"/megatron/launch_{restart}", agent_store)


def _shutdown_distributed():
    """Destroy the process groups we created before the interpreter finalises: a gloo group torn down
    during finalisation can abort a finished run ("terminate called without an active exception")."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _initialize_model_parallel(args):
    if parallel_state.model_parallel_is_initialized():
        print_rank_0("model parallel is already initialized")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        nccl_communicator_config_path=args.nccl_communicator_config_path,
        high_priority_stream_groups=args.high_priority_stream_groups,
        create_gloo_process_groups=args.use_gloo_process_groups,
    )
    if args.rank == 0:
        print(f"> initialized tensor model parallel with size {parallel_state.get_tensor_model_parallel_world_size()}")
        print(f"> initialized pipeline model parallel with size "
              f"{parallel_state.get_pipeline_model_parallel_world_size()}", flush=True)


def _set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False, inference_rng_tracker=False,
                     use_cudagraphable_rng=False, pp_group=None, dp_group=None, tp_group=None, ep_group=None,
                     etp_group=None, gtp_remat_group=None, egtp_remat_group=None):
    """python/numpy/torch seeded with seed + 100*pp_rank (+10*dp_rank); the RNG tracker adds TP states.
    Megatron's signature: the optional groups supply the ranks where parallel_state is not initialized."""
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"--seed ({seed_}) must be a positive integer")
    if gtp_remat_group is not None or egtp_remat_group is not None:
        raise ValueError("_set_random_seed: gtp_remat_group / egtp_remat_group (Megatron's generalized TP "
                         "recompute groups) have no counterpart here; leave them None")
    pp_rank = get_pg_rank(pp_group) if pp_group is not None else parallel_state.get_pipeline_model_parallel_rank()
    seed = seed_ + 100 * pp_rank
    if data_parallel_random_init:
        seed = seed + 10 * (get_pg_rank(dp_group) if dp_group is not None else parallel_state.get_data_parallel_rank())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    ranks = {name: get_pg_rank(group) if group is not None else None
             for name, group in (("tp_rank", tp_group), ("ep_rank", ep_group), ("etp_rank", etp_group))}
    # CUDA graphs capture dropout under the tracker's states: keep them graph-safe (GPU only).
    model_parallel_cuda_manual_seed(seed, te_rng_tracker, inference_rng_tracker,
                                    use_cudagraphable_rng=use_cudagraphable_rng and torch.cuda.is_available(), **ranks)


def _compile_dataset_helpers():
    """Build the C++ dataset index helpers on rank 0 if missing, then let everyone proceed."""
    if torch.distributed.get_rank() == 0:
        compile_helpers()
    torch.distributed.barrier()


def write_args_to_tensorboard():
    args, writer = get_args(), get_tensorboard_writer()
    if writer is not None:
        for arg in vars(args):
            writer.add_text(arg, str(getattr(args, arg)), global_step=args.iteration)
