"""Whole-iteration CUDA graphs (``--cuda-graph-impl full_iteration``).

A training step of a GPT launches thousands of small kernels from Python; with compiled layers on
gpt-1.3b the host needs about as long to launch them as the device needs to run them.
`FullCudaGraphWrapper` wraps a ``forward_backward_func``: the first ``cuda_graph_warmup_steps`` steps
run eagerly (compiling, cuBLAS / cuDNN plan selection, allocator warm-up, NCCL set-up), the next one
captures the forward and backward of every micro-batch (and the DDP gradient reduction) into one graph,
and every later step copies its micro-batches into the captured (static) input buffers and replays the
graph: one launch per step, after which the host reads the next step's micro-batches while the device
runs. The optimizer step stays outside the graph.

What the captured region may not do, and how the rest of the code keeps to it: no host
synchronisation (checks that read device values skip themselves while capturing; `train_step` reads
the replayed losses back while the optimizer step runs), fixed shapes and a fixed number of
micro-batches per step, and RNG states swapped only by reference (the tracker's graph-safe mode, whose
states are registered with the graph). `validate_cuda_graph_args` lists the refused combinations.
Evaluation (``forward_only=True``) always runs eagerly.
"""
from typing import Any, Callable, List, Optional

import torch

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def is_graph_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (host syncs are illegal)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class StaticBatches:
    """Persistent device copies of one step's micro-batches: the captured graph reads these buffers,
    and each step overwrites them in place with the next micro-batches from the real iterator."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: Optional[List[Any]] = None

    def load(self, batches: List[Any]) -> List[Any]:
        if self.buffers is None:
            self.buffers = [_allocate(b, self.device, f"micro-batch {i}") for i, b in enumerate(batches)]
        if len(batches) != len(self.buffers):
            raise RuntimeError(f"--cuda-graph-impl full_iteration: captured {len(self.buffers)} micro-batches "
                               f"per step, got {len(batches)}; the number of micro-batches must stay fixed "
                               "(no --rampup-batch-size)")
        for i, (dst, src) in enumerate(zip(self.buffers, batches)):
            _copy_into(dst, src, f"micro-batch {i}")
        return self.buffers


def _allocate(value, device, where):
    if torch.is_tensor(value):
        return torch.empty(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, dict):
        return {k: _allocate(v, device, f"{where}['{k}']") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_allocate(v, device, f"{where}[{i}]") for i, v in enumerate(value))
    return value  # plain Python values are baked into the graph; _copy_into checks they never change


def _copy_into(dst, src, where):
    if torch.is_tensor(dst):
        if not torch.is_tensor(src) or src.shape != dst.shape or src.dtype != dst.dtype:
            got = f"{tuple(src.shape)} {src.dtype}" if torch.is_tensor(src) else type(src).__name__
            raise RuntimeError(f"--cuda-graph-impl full_iteration: {where} is {got}, but the graph was captured "
                               f"with {tuple(dst.shape)} {dst.dtype}; graphs need fixed-shape batches")
        dst.copy_(src, non_blocking=True)
    elif isinstance(dst, dict):
        if set(dst) != set(src):
            raise RuntimeError(f"--cuda-graph-impl full_iteration: {where} has keys {sorted(src)}, "
                               f"captured {sorted(dst)}")
        for k in dst:
            _copy_into(dst[k], src[k], f"{where}['{k}']")
    elif isinstance(dst, (list, tuple)):
        if len(dst) != len(src):
            raise RuntimeError(f"--cuda-graph-impl full_iteration: {where} changed length")
        for i, (d, s) in enumerate(zip(dst, src)):
            _copy_into(d, s, f"{where}[{i}]")
    elif dst != src:
        raise RuntimeError(f"--cuda-graph-impl full_iteration: {where} changed from {dst!r} to {src!r}; "
                           "non-tensor batch fields are baked into the captured graph")


class _CudaGraph:
    """torch.cuda.CUDAGraph captured on a side stream, thread-local capture mode (a data-loader or
    checkpoint thread touching CUDA must not invalidate the capture).

    The eager warm-up steps run on that same stream (`warmup`). Autograd runs each leaf's gradient
    accumulation on the stream current when its AccumulateGrad node was made, and a node outlives the step
    that made it whenever anything still references that step's graph. A node made on the default
    (legacy) stream during warm-up and reused inside the capture makes the legacy stream wait on the
    capturing one, which invalidates the capture (``cudaErrorStreamCaptureImplicit``); made on the capture
    stream, it is harmless."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()
        self.stream = torch.cuda.Stream()

    def warmup(self, fn: Callable[[], Any]) -> Any:
        """One eager step on the capture stream, ordered after and before the caller's stream's work."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> Any:
        tracker = get_cuda_rng_tracker()
        tracker.set_graph_safe(True)  # keeps the states' values (training seeds it so from the start)
        for state in tracker.graph_safe_states():
            self.graph.register_generator_state(state)  # dropout under fork() advances on every replay
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager warm-up's cached blocks can then back the graph's own pool
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def replay(self) -> None:
        self.graph.replay()


class FullCudaGraphWrapper:
    """Callable with ``forward_backward_func``'s keyword signature; see the module docstring.

    ``graph_factory`` builds the object that runs the warm-up steps and captures and replays the graph
    (``warmup(fn) -> outputs``, ``capture(fn) -> outputs``, ``replay()``); the default is a real CUDA graph.
    Tests on CPU pass one whose replay re-runs the captured function, which exercises the static-buffer data
    flow without a GPU.
    """

    def __init__(self, forward_backward_func: Callable, cuda_graph_warmup_steps: int = 3,
                 graph_factory: Callable[[], Any] = _CudaGraph):
        if cuda_graph_warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps must be >= 1 (got {cuda_graph_warmup_steps}): "
                             "capture needs compiled kernels and initialised libraries from an eager step")
        if graph_factory is _CudaGraph and not torch.cuda.is_available():
            # Before the first step, not after the warm-up steps.
            raise RuntimeError("--cuda-graph-impl full_iteration needs a CUDA device; drop the flag on CPU")
        self.forward_backward_func = forward_backward_func
        self.warmup_steps = cuda_graph_warmup_steps
        self.graph_factory = graph_factory
        self.replayed = False  # whether the last training step ran from the graph (see train_step)
        self.steps = 0
        self.graph = None
        self.static = None  # one StaticBatches per data iterator the step reads, None for the others
        self.reads = None  # per data iterator: whether the warm-up steps read from it
        self.outputs = None
        self.captured_microbatches = None
        self.prefetched = None  # (iterators, micro-batches, batches or None at their end): the next step's

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int,
                 forward_only: bool = False, **kwargs):
        run = lambda it: self.forward_backward_func(  # noqa: E731
            forward_step_func=forward_step_func, data_iterator=it, model=model,
            num_microbatches=num_microbatches, forward_only=forward_only, **kwargs)
        self.replayed = False
        if forward_only:
            return run(data_iterator)
        if self.steps < self.warmup_steps:
            self.steps += 1
            if self.graph is None:
                self.graph = self.graph_factory()
            # Learn which iterators a step reads: TP rank > 0 reads none (it receives TP rank 0's batch by
            # broadcast), and of the interleaved schedule's per-chunk iterators only the first chunk's (first
            # stage) or the last chunk's (last stage). Only those are read ahead into buffers for the graph.
            counting = [None if it is None else _CountingIterator(it) for it in _as_list(data_iterator)]
            out = self.graph.warmup(lambda: run(_like(data_iterator, counting)))
            reads = [c is not None and c.count > 0 for c in counting]
            self.reads = reads if self.reads is None else [a or b for a, b in zip(self.reads, reads)]
            return out
        iterators = _as_list(data_iterator)
        if self.reads is None or len(self.reads) != len(iterators):
            raise RuntimeError("--cuda-graph-impl full_iteration: the data iterators changed after the warm-up")
        batches = self._take_prefetched(iterators, num_microbatches)
        if batches is None:
            batches = self._read(iterators, num_microbatches)
        if self.static is None:
            self.captured_microbatches = num_microbatches
            self.static = [None if b is None else StaticBatches(_device_of(model)) for b in batches]
            loaded = [None if b is None else static.load(b) for b, static in zip(batches, self.static)]
            # Fresh iterators over the buffers on every call of the captured function (a real graph calls it
            # once; the CPU tests' stand-in replays by calling it again).
            self.outputs = self.graph.capture(lambda: run(_like(data_iterator, [
                it if buffers is None else iter(buffers) for it, buffers in zip(iterators, loaded)])))
        else:
            if num_microbatches != self.captured_microbatches:
                raise RuntimeError(f"--cuda-graph-impl full_iteration: captured {self.captured_microbatches} "
                                   f"micro-batches per step, this step has {num_microbatches}")
            for b, static in zip(batches, self.static):
                if b is not None:
                    static.load(b)
        self.graph.replay()
        self.steps += 1
        self.replayed = True
        self._prefetch(iterators, num_microbatches)
        return self.outputs

    def _read(self, iterators, num_microbatches):
        return [[next(it) for _ in range(num_microbatches)] if read else None
                for it, read in zip(iterators, self.reads)]

    def _prefetch(self, iterators, num_microbatches):
        """Read the next step's micro-batches now, while the device replays this one. Read just before the
        next replay instead, the data loader's wait (collation, pinning, a worker behind) left the GPU idle,
        since the step before ends waiting for the device. They stay on the host until that step copies them
        into the static buffers, after this replay in stream order. An iterator that runs out here raises
        its StopIteration at the next step, which would have met it too; the read-ahead is dropped if that
        step is given other iterators. Nothing saves the iterators' position: a resumed run starts from the
        consumed-sample count, so a step read ahead and never run loses no data."""
        try:
            batches = self._read(iterators, num_microbatches)
        except StopIteration:
            batches = None
        self.prefetched = (iterators, num_microbatches, batches)

    def _take_prefetched(self, iterators, num_microbatches):
        ahead, self.prefetched = self.prefetched, None
        if ahead is None:
            return None
        its, n, batches = ahead
        if n != num_microbatches or len(its) != len(iterators) or any(a is not b for a, b in zip(its, iterators)):
            return None
        if batches is None:
            raise StopIteration
        return batches


def _as_list(data_iterator) -> list:
    return list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]


def _like(data_iterator, iterators: list):
    """``iterators`` in the form the schedule was given: one per model chunk, or the single iterator."""
    return type(data_iterator)(iterators) if isinstance(data_iterator, (list, tuple)) else iterators[0]


class _CountingIterator:
    """An iterator that counts what is taken from it (to learn which iterators a training step reads)."""

    def __init__(self, iterator):
        self.iterator, self.count = iterator, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return next(self.iterator)


def _device_of(model) -> torch.device:
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    for param in chunk.parameters():
        return param.device
    return torch.device("cuda", torch.cuda.current_device())
