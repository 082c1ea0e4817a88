"""Helpers shared by the pipeline schedules: devices, output deallocation, the interleaved plan."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.autograd.variable import Variable


def current_device() -> torch.device:
    """Current CUDA device when a GPU is visible, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False) -> None:
    """Free a sent stage output's storage but keep its grad_fn (pseudo-deallocation).

    Only ``.grad_fn`` is needed for the backward pass, which runs through ``custom_backward``
    because autograd would otherwise reject the 1-element placeholder's shape. Views are left
    alone: replacing a view's data frees nothing.
    """
    if out is None or not deallocate_pipeline_outputs or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Run backward from ``output`` without autograd's output/grad shape check."""
    if grad_output is None:
        assert output.numel() == 1, "implicit gradient only for a scalar loss"
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


@dataclass(frozen=True)
class Step:
    """One (microbatch, model chunk) entry of a schedule table."""

    microbatch: int
    chunk: int


def interleaved_table(num_microbatches: int, num_chunks: int, group_size: int) -> List[Step]:
    """Forward order on every rank: groups of ``group_size`` micro-batches, each group run
    through chunk 0, then chunk 1, ... (``num_microbatches`` is a multiple of ``group_size``)."""
    assert num_microbatches % group_size == 0, (num_microbatches, group_size)
    return [Step(m, c) for start in range(0, num_microbatches, group_size)
            for c in range(num_chunks) for m in range(start, start + group_size)]


def backward_table(forward_table: List[Step], num_chunks: int) -> List[Step]:
    """Backward order: the forward order with chunks reversed (last virtual stage first)."""
    return [Step(s.microbatch, num_chunks - 1 - s.chunk) for s in forward_table]


@dataclass
class InterleavedPlan:
    """Which forward/backward table entry a rank runs at each of its communication calls.

    Call ``n`` (from -1) runs forward entry ``n`` and backward entry ``n - warmup`` (when they
    exist), then exchanges with the neighbours. A rank's call ``n`` is paired with call ``n - 1``
    of the next rank and ``n + 1`` of the previous one (around the ring: rank 0's call ``n``
    with the last rank's call ``n - (pp - 1)``), so every send has a matching receive.
    """

    pp_size: int
    rank: int
    num_chunks: int
    forward: List[Step]
    backward: List[Step]
    warmup: int
    forward_only: bool

    @property
    def total(self) -> int:
        return len(self.forward)

    @property
    def num_calls(self) -> int:
        return self.total if self.forward_only else self.total + self.warmup

    def forward_at(self, call: int) -> Optional[Step]:
        return self.forward[call] if 0 <= call < self.total else None

    def backward_at(self, call: int) -> Optional[Step]:
        if self.forward_only:
            return None
        j = call - self.warmup
        return self.backward[j] if 0 <= j < self.total else None

    def sends_next(self, call: int) -> Optional[Step]:
        step = self.forward_at(call)
        if step is None or (self.rank == self.pp_size - 1 and step.chunk == self.num_chunks - 1):
            return None
        return step

    def sends_prev(self, call: int) -> Optional[Step]:
        step = self.backward_at(call)
        if step is None or (self.rank == 0 and step.chunk == 0):
            return None
        return step


def make_plan(pp_size: int, rank: int, num_microbatches: int, num_chunks: int, group_size: int,
              forward_only: bool) -> InterleavedPlan:
    forward = interleaved_table(num_microbatches, num_chunks, group_size)
    # Not capped at len(forward): with few micro-batches the extra calls are idle, which keeps the
    # warm-up of neighbouring ranks exactly 2 apart, as the call pairing requires.
    warmup = 2 * (pp_size - rank - 1) + (num_chunks - 1) * group_size
    warmup = len(forward) if forward_only else warmup
    return InterleavedPlan(pp_size, rank, num_chunks, forward, backward_table(forward, num_chunks),
                           warmup, forward_only)


def incoming(plan_of, rank: int, pp_size: int, call: int) -> Tuple[Optional[int], Optional[int]]:
    """Chunks of the tensors this rank receives at ``call``: (activation chunk, gradient chunk).

    ``plan_of(r)`` returns rank r's plan. The receiver mirrors what its paired sender does, so
    both ends always agree; the chunk says which queue the tensor joins.
    """
    prev, nxt = (rank - 1) % pp_size, (rank + 1) % pp_size
    prev_call = call + 1 if rank > 0 else call - (pp_size - 1)
    next_call = call - 1 if rank < pp_size - 1 else call + (pp_size - 1)
    sent_fwd = plan_of(prev).sends_next(prev_call)
    sent_bwd = plan_of(nxt).sends_prev(next_call)
    fwd_chunk = None if sent_fwd is None else sent_fwd.chunk + (1 if rank == 0 else 0)
    bwd_chunk = None if sent_bwd is None else sent_bwd.chunk - (1 if rank == pp_size - 1 else 0)
    return fwd_chunk, bwd_chunk
