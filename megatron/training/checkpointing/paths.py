"""Checkpoint directory names, the tracker file and atomic publication of a finished save."""
import errno
import os
import shutil
import signal
from typing import Optional, Tuple

import torch

from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

TRACKER_FNAME = "latest_checkpointed_iteration.txt"
LEGACY_FNAME = "model_optim_rng.pt"
FAULT_ENV = "MEGATRON_CKPT_FAULT"


def fault_point(stage: str, iteration: Optional[int] = None, path: Optional[str] = None) -> None:
    """Test-only fault injection (docs/fault_tolerance.md): ``MEGATRON_CKPT_FAULT=<stage>[:enospc][@<iteration>]``
    SIGKILLs this process when a save reaches ``stage`` (``:enospc``: raises "No space left on device" for
    ``path`` instead, a full disk), at every save or only at the save of ``<iteration>``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    spec, _, at = spec.partition("@")
    name, _, action = spec.partition(":")
    if name != stage or (at and (iteration is None or int(at) != iteration)):
        return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {FAULT_ENV})", path)
    os.kill(os.getpid(), signal.SIGKILL)


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FNAME)


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False, pipeline_parallel=None,
                        tensor_rank=None, pipeline_rank=None, expert_parallel=None, expert_rank=None,
                        return_base_dir: bool = False, basename: str = LEGACY_FNAME) -> str:
    """``{path}/iter_{:07d}`` (or ``release``); for the legacy format the per-rank file under
    ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]``."""
    directory = "release" if release else f"iter_{iteration:07d}"
    base = os.path.join(checkpoints_path, directory)
    if return_base_dir:
        return base
    initialized = ps.model_parallel_is_initialized()
    if pipeline_parallel is None:
        pipeline_parallel = initialized and ps.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = ps.get_tensor_model_parallel_rank() if initialized else 0
    if pipeline_rank is None:
        pipeline_rank = ps.get_pipeline_model_parallel_rank() if initialized else 0
    if expert_parallel is None:
        expert_parallel = initialized and ps.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = ps.get_expert_model_parallel_rank() if expert_parallel else 0
    name = f"mp_rank_{tensor_rank:02d}"
    if pipeline_parallel:
        name += f"_{pipeline_rank:03d}"
    if expert_parallel:
        name += f"_{expert_rank:03d}"
    return os.path.join(base, name, basename)


def read_metadata(tracker_filename: str) -> Tuple[int, bool]:
    """(iteration, release) from the tracker; the max over ranks, so all ranks load the same one."""
    with open(tracker_filename) as f:
        text = f.read().strip()
    release = text == "release"
    if not release:
        try:
            iteration = int(text)
        except ValueError:
            raise ValueError(f"tracker file {tracker_filename} holds {text!r}, not an iteration or 'release'; "
                             f"fix or delete it") from None
    else:
        iteration = 0
    if torch.distributed.is_initialized():
        t = torch.tensor([iteration], dtype=torch.long,
                         device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        if t.item() != iteration:
            print(f"WARNING: on rank {torch.distributed.get_rank()} found iteration {iteration} in the "
                  f"tracker, while the max over ranks is {t.item()}; using the max", flush=True)
        iteration = int(t.item())
    return iteration, release


def write_tracker(checkpoints_path: str, iteration: int) -> None:
    """Atomically point the tracker at ``iteration`` (write a temp file, fsync, rename)."""
    path = get_checkpoint_tracker_filename(checkpoints_path)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    fault_point("tracker_tmp_written", iteration)
    os.replace(tmp, path)


def staging_dir(final_dir: str) -> str:
    """Where a save is written before it is renamed into place (never matches ``iter_{:07d}``)."""
    return final_dir + ".tmp"


def publish_dir(tmp_dir: str, final_dir: str) -> None:
    """Rename the finished ``tmp_dir`` to ``final_dir``, replacing an older save of that iteration."""
    old = None
    if os.path.exists(final_dir):
        old = final_dir + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def iteration_dirs(checkpoints_path: str):
    """Sorted iterations of the ``iter_{:07d}`` directories under ``checkpoints_path``."""
    out = []
    for name in os.listdir(checkpoints_path) if os.path.isdir(checkpoints_path) else []:
        if name.startswith("iter_") and len(name) == 12 and name[5:].isdigit():
            out.append(int(name[5:]))
    return sorted(out)


def apply_retention(checkpoints_path: str, latest: int, retain_interval: Optional[int]) -> None:
    """``--save-retain-interval``: delete older saves whose iteration is not a multiple of the interval."""
    if not retain_interval:
        return
    for it in iteration_dirs(checkpoints_path):
        if it < latest and it % retain_interval != 0:
            shutil.rmtree(get_checkpoint_name(checkpoints_path, it, return_base_dir=True), ignore_errors=True)


def non_persistent_dir(args, base: Optional[str]) -> Optional[str]:
    """Where global non-persistent checkpoints live: --non-persistent-global-ckpt-dir, else <base>/non_persistent
    (Megatron's layout; ``base`` is --save when saving, --load when loading)."""
    if getattr(args, "non_persistent_global_ckpt_dir", None):
        return args.non_persistent_global_ckpt_dir
    return os.path.join(base, "non_persistent") if base else None


def drop_older(checkpoints_path: str, latest: int) -> None:
    """Non-persistent checkpoints: only the newest is kept, deleted after the next one is published."""
    for it in iteration_dirs(checkpoints_path):
        if it < latest:
            shutil.rmtree(get_checkpoint_name(checkpoints_path, it, return_base_dir=True), ignore_errors=True)


def previous_complete(checkpoints_path: str, before: int):
    """Iterations of complete checkpoints older than ``before``, newest first (for --ckpt-fallback-to-previous)."""
    return [it for it in reversed(iteration_dirs(checkpoints_path)) if it < before
            and detect_format(get_checkpoint_name(checkpoints_path, it, return_base_dir=True)) is not None]


def latest_iteration(checkpoints_path: str) -> Optional[int]:
    """The tracker's iteration without the collective of `read_metadata` (None: no readable tracker)."""
    try:
        with open(get_checkpoint_tracker_filename(checkpoints_path)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def detect_format(checkpoint_dir: str) -> Optional[str]:
    """'torch_dist' (complete metadata.json), 'torch' (mp_rank_* dirs), or None."""
    if not os.path.isdir(checkpoint_dir):
        return None
    if check_is_distributed_checkpoint(checkpoint_dir):
        return "torch_dist"
    if any(n.startswith("mp_rank_") for n in os.listdir(checkpoint_dir)):
        return "torch"
    return None
