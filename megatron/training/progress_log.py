"""``--log-progress``: ``progress.txt`` in the ``--save`` directory, Megatron's job-level record of a run.

Megatron's lines, one per event, tab-separated after a timestamp, the SLURM job id and the GPU count:
``Starting job`` when a job (a launch, or a restart after a failure) begins training, and at each checkpoint
``Saved checkpoint`` (``Saving async checkpoint`` when the write continues in the background, then ``Saved
async checkpoint`` once it is recorded) with the iteration, this job's throughput, the cumulative throughput
since the first job at this GPU count, the floating-point operations and the tokens so far. The file outlives
jobs: a requeued or restarted run appends to it, which is what makes the cumulative figure (restarts and
their lost time included) the one to compare across runs.
"""
import datetime
import os
import re
import time

import torch

_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_JOB = {"start": None, "flops": 0.0}


def _path(args):
    return os.path.join(args.save, "progress.txt") if getattr(args, "save", None) else None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def append(args, text: str, barrier: bool = True) -> None:
    """Append one line (rank 0 writes; ``barrier``: every rank reaches this point first)."""
    path = _path(args)
    if not getattr(args, "log_progress", False) or path is None:
        return
    if barrier and torch.distributed.is_initialized():
        torch.distributed.barrier()
    if _rank() != 0:
        return
    os.makedirs(args.save, exist_ok=True)
    stamp = datetime.datetime.now().strftime(_TIME_FORMAT)
    with open(path, "a") as f:
        f.write(f"{stamp}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {args.world_size}\t{text}\n")


def start_job(args) -> None:
    """The job's training begins (after any checkpoint load): its clock and floating-point baseline."""
    _JOB.update(start=time.time(), flops=float(args.num_floating_point_operations_so_far))
    append(args, "Starting job")


def _first_start_at_this_size(path, world_size):
    """(time, floating-point operations) of the first job since the GPU count last changed: its 'Starting
    job' line and the count of the last checkpoint line before it. None without such a line."""
    first, last_flops = None, 0.0
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split("\t")
        gpus = next((f.split(":", 1)[1].strip() for f in fields if f.startswith("# GPUs:")), None)
        if gpus is not None and gpus != str(world_size):
            first = None  # another GPU count: cumulative figures restart after it
        flops = re.search(r"Floating-point operations: ([0-9.eE+-]+)", line)
        if flops:
            last_flops = float(flops.group(1))
        if fields[-1] == "Starting job" and gpus == str(world_size) and first is None:
            first = (datetime.datetime.strptime(fields[0], _TIME_FORMAT).timestamp(), last_flops)
    return first


def saved_checkpoint(args, iteration: int, asynchronous: bool = False) -> None:
    """The checkpoint line: this job's and the cumulative TFLOP/s per GPU, operations and tokens so far."""
    if not getattr(args, "log_progress", False) or _path(args) is None:
        return
    now, flops, world = time.time(), float(args.num_floating_point_operations_so_far), args.world_size
    start = _JOB["start"] if _JOB["start"] is not None else now
    job = (flops - _JOB["flops"]) / max(now - start, 1e-9) / 1e12 / world
    first = _first_start_at_this_size(_path(args), world) if _rank() == 0 else None
    first_time, first_flops = first if first is not None else (start, _JOB["flops"])
    cumulative = (flops - first_flops) / max(now - first_time, 1e-9) / 1e12 / world
    tokens = args.consumed_train_samples * args.seq_length / 1e9
    what = "Saving async checkpoint" if asynchronous else "Saved checkpoint"
    append(args, f"{what}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                 f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\tFloating-point operations: {flops:.2e}\t"
                 f"Tokens (in billions): {tokens:.2f}")


def async_checkpoint_recorded(args, iteration: int) -> None:
    """An async checkpoint's write finished and the tracker points to it (called on rank 0 only)."""
    append(args, f"Saved async checkpoint\tIteration: {iteration}", barrier=False)
