"""CUDA graphs of the decode step, one per (batch bucket, KV-length bucket, greedy-only) key.

A decode step of an 8B model is ~1,000 small kernels; replaying them as one graph removes the launch
gaps that otherwise dominate batch-1 decoding. The step reads and writes only static buffers (tokens,
positions, sampling parameters, the KV cache), so a graph captured once replays for any requests.
"""
from typing import Callable, List, Sequence, Union

import torch


def bucket(n: int, cap: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum), at most ``cap``."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, cap)


def batch_ladder(max_batch: int, count: int, distribution: str = "exponential") -> List[int]:
    """The decode graphs' batch sizes (Megatron's --inference-dynamic-batching-num-cuda-graphs), ascending; a step
    of n requests runs the smallest size >= n. ``exponential``: ``max_batch`` halved down to 1, at most ``count``
    of them, trimmed from the middle (the largest and 1 kept). ``linear``
    (--inference-dynamic-batching-cuda-graph-sizing-distribution): ``count`` sizes evenly spaced up to ``max_batch``
    (step ceil(max_batch / count))."""
    if count < 1:
        raise ValueError(f"--inference-dynamic-batching-num-cuda-graphs ({count}) must be >= 1")
    if distribution == "linear":
        step = -(-max_batch // count)
        return sorted(set(range(step, max_batch, step)) | {max_batch})
    if distribution != "exponential":
        raise ValueError(f"--inference-dynamic-batching-cuda-graph-sizing-distribution {distribution}: use "
                         "exponential or linear")
    sizes, b = {max_batch, 1}, max_batch
    while b > 1:
        sizes.add(b)
        b //= 2
    ladder = sorted(sizes, reverse=True)
    while len(ladder) > max(count, 1) and len(ladder) > 1:
        ladder.pop(-2 if len(ladder) > 2 else -1)
    return sorted(ladder)


def ladder_bucket(n: int, ladder: List[int]) -> int:
    """The smallest size of ``ladder`` (ascending) >= n, else its largest."""
    return next((b for b in ladder if b >= n), ladder[-1])


class DecodeGraphs:
    """``capture`` False (CPU): each bucketed step runs eagerly, the very calls a graph would record."""

    def __init__(self, step_fn, state_buffers: Union[Sequence[torch.Tensor], Callable[[], List[torch.Tensor]]],
                 capture: bool = True):
        self.step_fn = step_fn  # step_fn(B, kv_len, greedy_only) runs one decode step on the buffers
        # Buffers a step updates in place, restored after the warm-up step: a list, or a function giving
        # them at capture time (a hybrid model's recurrent states exist only once a prefill made them).
        self.state_buffers = state_buffers
        self.capture = capture
        self.graphs = {}
        self.pool = None
        self.replays = 0  # decode steps run through here (tests check that decoding really took this path)

    def run(self, batch: int, kv_len: int, greedy_only: bool) -> None:
        key = (batch, kv_len, greedy_only)
        self.replays += 1
        if not self.capture:
            self.step_fn(*key)
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        graph.replay()

    def _buffers(self) -> List[torch.Tensor]:
        return list(self.state_buffers() if callable(self.state_buffers) else self.state_buffers)

    def warm_up(self, key) -> None:
        """Run one step eagerly (lazy allocations, cuBLAS workspaces) and undo its state updates. The
        KV-cache writes it made are the ones the first replay repeats, but a recurrent layer's state update
        (conv window, SSM or delta-rule state) is not idempotent: left in place, every new graph would
        advance the hybrid model's states by one extra token."""
        buffers = self._buffers()
        saved = [b.clone() for b in buffers]
        self.step_fn(*key)
        for buf, value in zip(buffers, saved):
            buf.copy_(value)

    def _capture(self, key):
        side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.warm_up(key)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step_fn(*key)
        return graph
