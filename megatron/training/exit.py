"""Exit conditions: signal (all ranks agree), wall-clock duration (MAX over ranks), iteration interval."""
import signal
import time

import torch


class DistributedSignalHandler:
    """Records that `signal_name` arrived; `signals_received()` all-gathers the flag so ranks agree."""

    def __init__(self, signal_name="SIGTERM"):
        self.sig = getattr(signal, signal_name)
        self._signal_received = False
        self.released = False
        self.original_handler = None

    def signals_received(self):
        flag = torch.tensor([int(self._signal_received)], dtype=torch.int32, device=_comm_device())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def __enter__(self):
        self._signal_received = False
        self.released = False
        self.original_handler = signal.getsignal(self.sig)

        def handler(signum, frame):
            self._signal_received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()

    def release(self):
        if self.released:
            return False
        signal.signal(self.sig, self.original_handler)
        self.released = True
        return True


def _comm_device():
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def duration_exceeded(train_start_time, limit_minutes):
    """True on every rank when any rank has run longer than `limit_minutes` (MAX all-reduce)."""
    elapsed = torch.tensor([(time.time() - train_start_time) / 60.0], dtype=torch.float, device=_comm_device())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return elapsed.item() > limit_minutes, elapsed.item()
