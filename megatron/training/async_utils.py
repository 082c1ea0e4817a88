"""The application's queue of background checkpoint saves (`--async-save`).

`maybe_finalize_async_save` is called by the training loop every iteration (and with ``blocking=True`` at
exit); it is collective, so every rank must call it at the same points.
"""
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

_async_calls_queue = None


def _queue() -> AsyncCallsQueue:
    global _async_calls_queue
    if _async_calls_queue is None:
        _async_calls_queue = AsyncCallsQueue()
    return _async_calls_queue


def schedule_async_save(async_request: AsyncRequest) -> None:
    _queue().schedule_async_request(async_request)


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Record every background save that all ranks finished; ``blocking`` waits for all pending ones."""
    global _async_calls_queue
    if _async_calls_queue is None:
        return
    _async_calls_queue.maybe_finalize_async_calls(blocking=blocking or terminate)
    if terminate:
        _async_calls_queue = None


def is_empty_async_queue() -> bool:
    return _async_calls_queue is None or _async_calls_queue.get_num_unfinalized_calls() == 0


def failed_async_saves():
    return [] if _async_calls_queue is None else list(_async_calls_queue.failed)
