"""Whole-iteration CUDA graphs (``--cuda-graph-impl full_iteration``).

A training step of a GPT launches thousands of small kernels from Python; with compiled layers on
gpt-1.3b the host needs about as long to launch them as the device needs to run them.
`FullCudaGraphWrapper` wraps a ``forward_backward_func``: the first ``cuda_graph_warmup_steps`` steps
run eagerly (compiling, cuBLAS / cuDNN plan selection, allocator warm-up, NCCL set-up), the next one
captures the forward and backward of every micro-batch (and the DDP gradient reduction) into one graph,
and every later step copies its micro-batches into the captured (static) input buffers and replays the
graph: one launch per step. The optimizer step stays outside the graph.

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
    checkpoint thread touching CUDA must not invalidate the capture)."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()
        self.stream = torch.cuda.Stream()

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

    ``graph_factory`` builds the capture/replay object (``capture(fn) -> outputs``, ``replay()``);
    the default is a real CUDA graph. Tests on CPU pass one whose replay re-runs the captured
    function, which exercises the static-buffer data flow without a GPU.
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
        self.static = None
        self.outputs = None
        self.captured_microbatches = None

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
            return run(data_iterator)
        iterator = data_iterator[0] if isinstance(data_iterator, (list, tuple)) else data_iterator
        # A rank without the iterator (TP rank > 0: its forward step receives TP rank 0's batch by broadcast
        # and never reads one) captures that broadcast's receiving side and has no buffers to refill.
        batches = None if iterator is None else [next(iterator) for _ in range(num_microbatches)]
        if self.graph is None:
            self.graph = self.graph_factory()
            self.captured_microbatches = num_microbatches
            if batches is None:
                self.outputs = self.graph.capture(lambda: run(data_iterator))
            else:
                self.static = StaticBatches(_device_of(model))
                static = self.static.load(batches)
                self.outputs = self.graph.capture(lambda: run(_wrap_like(data_iterator, iter(static))))
        else:
            if num_microbatches != self.captured_microbatches:
                raise RuntimeError(f"--cuda-graph-impl full_iteration: captured {self.captured_microbatches} "
                                   f"micro-batches per step, this step has {num_microbatches}")
            if (batches is None) != (self.static is None):
                raise RuntimeError("--cuda-graph-impl full_iteration: the data iterator appeared or vanished on "
                                   "this rank after the capture")
            if batches is not None:
                self.static.load(batches)
        self.graph.replay()
        self.steps += 1
        self.replayed = True
        return self.outputs


def _wrap_like(data_iterator, iterator):
    return [iterator] if isinstance(data_iterator, (list, tuple)) else iterator


def _device_of(model) -> torch.device:
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    for param in chunk.parameters():
        return param.device
    return torch.device("cuda", torch.cuda.current_device())
