"""One launch order, the same on every rank, for the expert-parallel collectives of two host threads.

Under --overlap-moe-expert-parallel-comm (pipeline_parallel/combined_1f1b.py) one micro-batch's forward runs in
a second host thread beside the previous one's backward, each launching its own collectives: the forward's on
the EP communicator, the backward's on its twin. NCCL asks that collectives of different communicators be
launched in the same order on every rank, because a rank's device work can wait on whatever was enqueued before
it: a stream wait, a gradient accumulated on the other micro-batch's stream, two streams sharing one of
CUDA_DEVICE_MAX_CONNECTIONS' hardware queues, the device-wide wait of cudaFree when the caching allocator
returns memory under pressure. Left to the threads' timing, rank 0 may launch the forward's all-to-all before
the backward's and rank 1 the reverse, and each then waits for a kernel the other never gets to: a hang (Qwen3-
30B-A3B's shape at EP=4 on 4 H200s stopped in its fourth iteration, after the routing's imbalance grew).

Here each window (one forward beside one backward) merges the two sides' collectives by their place within
their own side: the forward's k-th of F before the backward's j-th of B when k / F <= j / B, with F and B
counted in the first step, which runs the two sides one after the other. The merge depends only on those
counts, which are the same on every rank, so every rank launches one sequence; a side waits on the host only
until the other side has launched the collectives ahead of its own. By induction over that sequence, every
collective's peers are launched and every device wait points at earlier work: no cycle is left. A side that
ends (or fails) releases the other.
"""
import contextlib
import threading

FORWARD, BACKWARD = 0, 1


class LaunchOrder:
    """The merge described in the module docstring; off (no waiting, no lock) outside a window."""

    def __init__(self):
        self._cond = threading.Condition()
        self._mode = None  # None: off; "record": count each side's collectives; "order": enforce the merge
        self._launched = [0, 0]
        self._finished = [False, False]
        self.per_window = [0, 0]  # each side's collectives in one window, counted by a "record" window
        self.trace = None  # a list to append each launched side to (tests), else None

    @contextlib.contextmanager
    def window(self, *, record: bool):
        """One forward beside one backward; ``record``: they run one after the other and are counted."""
        with self._cond:
            self._mode = "record" if record else "order"
            self._launched, self._finished = [0, 0], [False, False]
        try:
            yield
        finally:
            with self._cond:
                if record:
                    self.per_window = list(self._launched)
                self._mode = None
                self._cond.notify_all()

    def finish(self, side: int) -> None:
        """``side`` launches nothing more in this window (it returned or raised)."""
        with self._cond:
            self._finished[side] = True
            self._cond.notify_all()

    def _ahead(self, side: int, k: int) -> int:
        """How many of the other side's collectives the merge puts before this side's k-th."""
        mine, other = self.per_window[side], self.per_window[1 - side]
        if other == 0:
            return 0
        if mine == 0:  # not seen when counted: after all of the other side's
            return other
        if side == FORWARD:  # backward j goes first when j / B < k / F
            ahead = -(-k * other // mine)
        else:  # forward k' goes first when k' / F <= k / B
            ahead = k * other // mine + 1
        return min(ahead, other)

    @contextlib.contextmanager
    def turn(self, side: int):
        """Around the launch of one collective of ``side``: waits for the collectives the merge puts first."""
        if self._mode is None:
            yield
            return
        with self._cond:
            if self._mode == "order":
                need = self._ahead(side, self._launched[side])
                other = 1 - side
                self._cond.wait_for(lambda: self._mode != "order" or self._finished[other]
                                    or self._launched[other] >= need)
            if self.trace is not None:
                self.trace.append(side)
        try:
            yield
        finally:
            with self._cond:
                self._launched[side] += 1
                self._cond.notify_all()


ORDER = LaunchOrder()


def forward_turn():
    """Around a collective that the forward of an MoE layer launches."""
    return ORDER.turn(FORWARD)


def backward_turn():
    """Around a collective that the backward of an MoE layer launches."""
    return ORDER.turn(BACKWARD)
