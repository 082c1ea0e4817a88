"""--overlap-moe-expert-parallel-comm for the schedule without pipelining: micro-batch i + 1's forward
runs beside micro-batch i's backward, so each one's expert-parallel all-to-all (and the host wait for
the token counts before it) hides behind the other's compute.

    main thread:    F0 | B0    | B1    | ... | B(M-1)
    forward thread:    | F1    | F2    | ... |
    CUDA streams:   S0 | S0+S1 | S1+S0 | ... |          (micro-batch i runs on S[i % 2])

Megatron interleaves the two at layer granularity in one thread (its combined 1F1B plan); here each
side keeps its own program order in its own host thread and CUDA stream, and the GPU interleaves them.
The forward and the backward share no communicator: the MoE dispatcher's backward exchange runs on a
twin of the EP group (token_dispatcher.backward_twin_group), and the data-parallel reduction waits
for the last backward, which runs alone. config_checks.check_ep_overlap lists what else is excluded.
Each side runs the same operations in the same order as the plain schedule: the results are the same.

The first step of each model runs this plan on the same streams without the second thread. Two host
threads whose NCCL kernels wait on each other across ranks must never stop at an implicit device
synchronisation: growing the caching allocator (cudaMalloc), allocating pinned host memory, or creating a
communicator at its first collective all wait for the other stream's all-to-all, which waits for a peer
that is stuck the same way. The sequential first step makes each side stream's memory pool, the pinned
count buffers (one per host thread: the forward thread runs its forwards here too) and both EP communicators
exist before the threads run concurrently (at EP=4 on 4 H200s the concurrent first step hung in iteration 1).
It also counts each side's collectives, from which every later step launches them in one order on every rank
(transformer/moe/launch_order.py): implicit synchronisations aside, NCCL needs that order across communicators.
"""
import contextlib
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron.core.pipeline_parallel import step
from megatron.core.transformer.moe.launch_order import BACKWARD, FORWARD, ORDER

_EXECUTOR = {}
_STREAMS = {}
_WARMED = weakref.WeakSet()  # model chunks whose first step ran sequentially (see the module docstring)
# How many forwards ran beside a backward, for tests and the docs' measurements.
stats = {"overlapped_forwards": 0}


# The interpreter lock's hand-off period while the two sides run at once (CPython's default is 5 ms).
# Both host threads run Python: the forward thread launches its operators, and the backward's Python parts
# (custom autograd functions' backward, the DDP gradient hooks) run on autograd's device thread. A thread that
# wants the lock while the other computes gets it only when the holder blocks or after this period, so with
# the default each Python node of the backward may wait up to 5 ms behind a forward that is launching, and the
# GPU idles meanwhile (Qwen3-30B-A3B's shape at EP=2: ~70 ms of an iteration's host time in such waits).
GIL_SWITCH_S = 2.5e-4


@contextlib.contextmanager
def _quick_gil_handoff():
    """The interpreter lock changes hands within ``GIL_SWITCH_S`` while both sides run; restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, GIL_SWITCH_S))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _executor() -> ThreadPoolExecutor:
    if "pool" not in _EXECUTOR:
        _EXECUTOR["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-overlap-forward")
    return _EXECUTOR["pool"]


def _streams():
    """Two side streams on CUDA (one per micro-batch in flight) and the parameters' gradient-accumulation
    stream (`_hold_accumulators`), None on CPU."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = tuple(torch.cuda.Stream(device=device) for _ in range(3))
    return _STREAMS[device]


def _hold_accumulators(model, context) -> list:
    """Make every trainable parameter's AccumulateGrad node inside ``context`` (the accumulation stream) and
    hold it for the step.

    Autograd accumulates a leaf's gradient on the stream that was current when its AccumulateGrad node was
    made, and the node lives as long as any graph holds it. Here graphs overlap (micro-batch i + 1's forward
    is built while i's backward runs), so the nodes made by the step's first forward, on side stream 0, would
    serve every backward: each odd micro-batch's backward, on side stream 1, would queue its gradient
    accumulations (and the DDP hook's main_grad adds) on stream 0 between the next forward's kernels, each
    waiting for the backward to produce that gradient. The forward would then advance only as fast as the
    backward it should hide. On a third stream, which carries nothing else, the accumulations wait for their
    own backward alone. That every accumulation now runs on another stream than the gradient's producer is
    intended, so autograd's warning about such a mismatch is switched off (it is meant for nodes left over
    by accident)."""
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)
    with context, torch.enable_grad():
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters() if p.requires_grad]


def _on(streams, i):
    return contextlib.nullcontext() if streams is None else torch.cuda.stream(streams[i % 2])


def _join(streams):
    """The caller's stream waits for the side streams, and they for it: everything before this point
    (grad accumulation of the backward, the forward's outputs) is ordered before everything after."""
    if streams is None:
        return
    main = torch.cuda.current_stream()
    for s in streams:
        main.wait_stream(s)
    for s in streams:
        s.wait_stream(main)


def run_overlapped(forward_step_func, data_iterator, model, state: step.RunState, sync: step.GradSync):
    """Forward and backward of ``state.num_microbatches`` micro-batches (>= 2) of one model chunk, each
    forward after the first beside the previous backward. DP grad sync stays off (``sync``) until the
    last backward, which runs alone."""
    config, n = state.config, state.num_microbatches
    streams = _streams()
    device = torch.cuda.current_device() if streams is not None else None
    grad_enabled = torch.is_grad_enabled()

    def forward(i):
        if threading.current_thread() is not threading.main_thread():
            torch.set_grad_enabled(grad_enabled)  # grad mode and the CUDA device are per thread
            if device is not None:
                torch.cuda.set_device(device)
        try:
            with _on(streams, i):
                return step.forward_microbatch(forward_step_func, data_iterator, model, None, state, True)
        finally:
            ORDER.finish(FORWARD)

    def backward(i, output):
        try:
            with _on(streams, i):
                step.backward_step(None, output, None, config)
        finally:
            ORDER.finish(BACKWARD)

    concurrent = model in _WARMED
    _WARMED.add(model)
    _join(streams)
    held = [] if streams is None else _hold_accumulators(model, torch.cuda.stream(streams[2]))
    output = forward(0)
    for i in range(1, n):
        _join(streams)
        if not concurrent:  # the first step: the same plan, one side after the other, each on its own thread
            with ORDER.window(record=True):  # and each side's collectives counted for the launch order
                following = _executor().submit(forward, i).result()
                backward(i - 1, output)
            output = following
            continue
        with ORDER.window(record=False), _quick_gil_handoff():  # both sides' collectives in one order
            pending = _executor().submit(forward, i)
            try:
                backward(i - 1, output)
            finally:
                output = pending.result()  # the forward's error, if any, surfaces here
        stats["overlapped_forwards"] += 1
    _join(streams)
    sync.enable(0)  # the last backward launches the data-parallel grad reduction
    backward(n - 1, output)
    _join(streams)
    held.clear()  # every backward of the step has run: the next step makes its nodes again
