"""The loop of the interleaved 1F1B schedule, driven by an ``InterleavedPlan`` (see utils.py).

Each communication call runs at most one forward and one backward, then one batched exchange.
Received tensors wait in per-chunk FIFO queues: a chunk consumes micro-batches in increasing
order and its senders produce them in the same order, so the queue head is always the right one.
"""
from collections import deque

from megatron.core.pipeline_parallel import step as microbatch
from megatron.core.pipeline_parallel.utils import deallocate_output_tensor, incoming


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
        inp = None if is_first_vstage(c) else q.inputs[c].popleft()
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
        out_grad = None if is_last_vstage(c) else q.grads[c].popleft()
        if last_backward[c] == call:
            sync.enable(c)
        in_grad = microbatch.backward_step(inp, out, out_grad, config)
        if last_backward[c] == call:
            sync.chunk_done(c)
        return in_grad if plan.sends_prev(call) is not None else None

    for call in range(-1, plan.num_calls):
        send_fwd = run_forward(call)
        send_bwd = run_backward(call)
        fwd_chunk, bwd_chunk = incoming(plan_of, rank, pp, call)
        recv_prev, recv_next = fwd_chunk is not None, bwd_chunk is not None
        got_fwd, got_bwd = _exchange(comm, send_fwd, send_bwd, recv_prev, recv_next, shape)
        deallocate_output_tensor(send_fwd, dealloc)
        if got_fwd is not None:
            q.inputs[fwd_chunk].append(got_fwd)
        if got_bwd is not None:
            q.grads[bwd_chunk].append(got_bwd)
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
