"""The loop of the interleaved 1F1B schedule, driven by an ``InterleavedPlan`` (see utils.py).

Each communication call runs at most one forward and one backward and exchanges tensors with the
neighbour stages. Received tensors wait in per-chunk FIFO queues: a chunk consumes micro-batches in
increasing order and its senders produce them in the same order, so the queue head is always the right one.

Two ways to exchange (``config.overlap_p2p_comm``):
- synchronous (``--no-overlap-p2p-communication``): one batch with both directions after the call's
  backward, waited on at once;
- overlapped (the default with virtual stages): the forward-direction batch (send the output to the next
  stage, receive an activation from the previous one) is posted right after the call's forward, before its
  backward runs, and the backward-direction batch (send the input grad to the previous stage, receive an
  output grad from the next) right after the backward. Nothing waits at the end of the call: a received
  tensor is waited on when its queue hands it out; a sent one before the next batch of its direction is
  posted (only then is a sent output freed, ``deallocate_pipeline_outputs``) and at the latest at the end.
  As in Megatron, warm-up and flush calls (a forward or a backward alone) still wait for their batches at
  their end unless ``overlap_p2p_comm_warmup_flush``.

Why the overlapped batches match on both ends: ops to one peer are matched in posting order. Rank r's call
n pairs with call n - 1 of the next rank and n + 1 of the previous one (utils.InterleavedPlan; around the
ring too), so a batch keyed (n + r, direction) only ever meets batches with the same key, and every rank
posts in increasing key order, the forward-direction batch of a call before its backward-direction batch.
Hence the per-peer orders agree on both ends, also at PP=2, where the previous and the next stage are one
rank and both directions share its link. Before posting a batch a rank waits only on batches of smaller
keys, so no rank waits for a batch its peer has not posted yet.
"""
from collections import deque

from megatron.core.pipeline_parallel import step as microbatch
from megatron.core.pipeline_parallel.utils import deallocate_output_tensor, incoming


class _Received:
    """A received tensor and the handle of the exchange that fills it (None: already complete)."""

    __slots__ = ("tensor", "handle")

    def __init__(self, tensor, handle=None):
        self.tensor, self.handle = tensor, handle

    def take(self):
        if self.handle is not None:
            self.handle.wait()
        return self.tensor


class _Queues:
    def __init__(self, num_chunks):
        self.inputs = [deque() for _ in range(num_chunks)]  # activations from the previous stage
        self.grads = [deque() for _ in range(num_chunks)]  # output grads from the next stage
        self.in_flight = [deque() for _ in range(num_chunks)]  # (input, output) awaiting backward


def _last_backward_calls(plan):
    """Call index of each chunk's last backward, where its grad sync must be re-enabled."""
    last = {}
    for call in range(plan.num_calls):
        step = plan.backward_at(call)
        if step is not None:
            last[step.chunk] = call
    return last


class _Overlapped:
    """The overlapped exchange: posts each direction's batch and retires (waits on, then frees the sent
    output of) the previous batch of that direction when the next one is posted."""

    def __init__(self, comm, shape, dealloc):
        self.comm, self.shape, self.dealloc = comm, shape, dealloc
        self.last = {"forward": None, "backward": None}  # (handle, sent output to free) per direction
        self.posted = []  # every handle, checked at the end

    def _retire(self, direction):
        if self.last[direction] is not None:
            handle, sent_output = self.last[direction]
            handle.wait()  # an isend may still read the output until its request completes
            deallocate_output_tensor(sent_output, self.dealloc)
            self.last[direction] = None

    def forward(self, send, recv):
        """Post the forward-direction batch; returns the activation on its way (or None)."""
        if send is None and not recv:
            return None
        self._retire("forward")
        got, handle = self.comm.send_forward_recv_forward_async(send, recv, self.shape)
        self.last["forward"] = (handle, send)
        self.posted.append(handle)
        return None if got is None else _Received(got, handle)

    def backward(self, send, recv):
        """Post the backward-direction batch; returns the output grad on its way (or None)."""
        if send is None and not recv:
            return None
        self._retire("backward")
        got, handle = self.comm.send_backward_recv_backward_async(send, recv, self.shape)
        self.last["backward"] = (handle, None)  # input grads are not freed here
        self.posted.append(handle)
        return None if got is None else _Received(got, handle)

    def drain(self):
        """Retire the last batch of each direction (end of a warm-up/flush call, end of the schedule)."""
        self._retire("forward")
        self._retire("backward")

    def all_done(self):
        """Every posted request completed: sends retired, receives taken from their queues."""
        self.posted = [h for h in self.posted if not h.done]
        return not self.posted


def run_interleaved(forward_step_func, iterators, models, comm, plan_of, state, shape):
    config = state.config
    pp, rank, num_chunks = comm.world_size, comm.rank, len(models)
    plan = plan_of(rank)
    q = _Queues(num_chunks)
    sync = microbatch.GradSync(config, models)
    sync.disable_all()
    last_backward = _last_backward_calls(plan)
    param_sync = getattr(config, "param_sync_func", None)
    dealloc = getattr(config, "deallocate_pipeline_outputs", False)
    overlapped = _Overlapped(comm, shape, dealloc) if getattr(config, "overlap_p2p_comm", False) else None
    overlap_warmup_flush = getattr(config, "overlap_p2p_comm_warmup_flush", False)
    started = set()

    def is_first_vstage(chunk):
        return rank == 0 and chunk == 0

    def is_last_vstage(chunk):
        return rank == pp - 1 and chunk == num_chunks - 1

    def run_forward(call):
        step = plan.forward_at(call)
        if step is None:
            return None
        c = step.chunk
        if param_sync is not None and c not in started:
            funcs = param_sync if isinstance(param_sync, (list, tuple)) else [param_sync]
            funcs[c if len(funcs) > 1 else 0](models[c].parameters())
        started.add(c)
        inp = None if is_first_vstage(c) else q.inputs[c].popleft().take()
        out = microbatch.forward_microbatch(forward_step_func, iterators[c], models[c], inp, state,
                            is_last_vstage(c))
        if not state.forward_only:
            q.in_flight[c].append((inp, out))
        return out if plan.sends_next(call) is not None else None

    def run_backward(call):
        step = plan.backward_at(call)
        if step is None:
            return None
        c = step.chunk
        inp, out = q.in_flight[c].popleft()
        out_grad = None if is_last_vstage(c) else q.grads[c].popleft().take()
        if last_backward[c] == call:
            sync.enable(c)
        in_grad = microbatch.backward_step(inp, out, out_grad, config)
        if last_backward[c] == call:
            sync.chunk_done(c)
        return in_grad if plan.sends_prev(call) is not None else None

    def enqueue(queue, received):
        if received is not None:
            queue.append(received)

    for call in range(-1, plan.num_calls):
        fwd_chunk, bwd_chunk = incoming(plan_of, rank, pp, call)
        if overlapped is not None:
            send_fwd = run_forward(call)
            enqueue(q.inputs[fwd_chunk or 0], overlapped.forward(send_fwd, fwd_chunk is not None))
            send_bwd = run_backward(call)
            enqueue(q.grads[bwd_chunk or 0], overlapped.backward(send_bwd, bwd_chunk is not None))
            steady = plan.forward_at(call) is not None and plan.backward_at(call) is not None
            if not (steady or overlap_warmup_flush):
                overlapped.drain()
            continue
        send_fwd = run_forward(call)
        send_bwd = run_backward(call)
        got_fwd, got_bwd = _exchange(comm, send_fwd, send_bwd, fwd_chunk is not None, bwd_chunk is not None,
                                     shape)
        deallocate_output_tensor(send_fwd, dealloc)
        enqueue(q.inputs[fwd_chunk or 0], None if got_fwd is None else _Received(got_fwd))
        enqueue(q.grads[bwd_chunk or 0], None if got_bwd is None else _Received(got_bwd))
    if overlapped is not None:
        overlapped.drain()
        assert overlapped.all_done(), "interleaved schedule left a p2p request pending"
    sync.finish()
    assert all(not d for d in q.inputs + q.grads + q.in_flight), "interleaved plan left work behind"


def _exchange(comm, send_fwd, send_bwd, recv_prev, recv_next, shape):
    """Pick the p2p helper (and so the timer name) by which directions are active."""
    forward_active = send_fwd is not None or recv_prev
    backward_active = send_bwd is not None or recv_next
    if forward_active and backward_active:
        return comm.send_forward_backward_recv_forward_backward(
            send_fwd, send_bwd, recv_prev, recv_next, shape)
    if forward_active:
        return comm.send_forward_recv_forward(send_fwd, recv_prev, shape), None
    if backward_active:
        return None, comm.send_backward_recv_backward(send_bwd, recv_next, shape)
    return None, None
