"""The application's queue of background checkpoint saves (`--async-save`) and their host buffers.

`maybe_finalize_async_save` is called by the training loop every iteration (and with ``blocking=True`` at
exit); it is collective, so every rank must call it at the same points. `host_staging` gives the buffers
async saves copy the state into (kept for the whole run unless --no-async-save-pinned-buffers); they are
freed when the queue is terminated at the end of training.
"""
import shutil
from typing import Optional

import torch

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.staging import HostStaging

_async_calls_queue = None
_host_staging: Optional[HostStaging] = None
_last_staging: Optional[HostStaging] = None  # the buffers of the latest save (reusable or not)


def _queue() -> AsyncCallsQueue:
    global _async_calls_queue
    if _async_calls_queue is None:
        _async_calls_queue = AsyncCallsQueue()
    return _async_calls_queue


def host_staging(reuse: bool = True) -> HostStaging:
    """The buffers of the next async save: the run's reusable (page-locked on CUDA) ones, or with ``reuse``
    False a pageable set freed once written."""
    global _host_staging, _last_staging
    if not reuse:
        _last_staging = HostStaging(pin=False, keep=False)
    else:
        if _host_staging is None:
            _host_staging = HostStaging()
        _last_staging = _host_staging
    return _last_staging


def last_staging_stats() -> dict:
    """`HostStaging.stats` of the latest async save ({} when there was none), plus ``copy_s``: the device
    time of its background copy once that finished (absent on CPU, with pageable buffers or while it runs)."""
    if _last_staging is None:
        return {}
    stats, copy_s = dict(_last_staging.stats), _last_staging.copy_seconds()
    return stats if copy_s is None else {**stats, "copy_s": copy_s}


def schedule_async_save(async_request: AsyncRequest) -> None:
    _queue().schedule_async_request(async_request)


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Record every background save that all ranks finished; ``blocking`` waits for all pending ones.
    ``terminate`` also frees the host buffers."""
    global _async_calls_queue, _host_staging
    if _async_calls_queue is None:
        return
    failed_before = len(_async_calls_queue.failed)
    _async_calls_queue.maybe_finalize_async_calls(blocking=blocking or terminate)
    _remove_staging(_async_calls_queue.failed[failed_before:])
    if terminate:
        _async_calls_queue = None
        if _host_staging is not None:
            _host_staging.free()
            _host_staging = None


def _remove_staging(failed_dirs) -> None:
    """A failed background save (a full disk...) was never published: rank 0 deletes its staging directory
    (``iter_N.tmp``), whose partial files would only take space; the latest checkpoint stays as it was."""
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    for path in failed_dirs:
        if rank0 and path.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)


def is_empty_async_queue() -> bool:
    return _async_calls_queue is None or _async_calls_queue.get_num_unfinalized_calls() == 0


def failed_async_saves():
    return [] if _async_calls_queue is None else list(_async_calls_queue.failed)
