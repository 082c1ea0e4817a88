"""The interleaved plan, simulated on all ranks at once without any process group.

Every rank's call ``n`` happens at global time ``n + rank``; at each time all ranks compute, then all
messages are delivered. The simulation checks that each forward/backward finds exactly the micro-batch
it needs at the head of its queue and that receivers predict (``incoming``) what senders send.
"""
from collections import deque

import pytest

from megatron.core.pipeline_parallel.schedules import check_interleaved_microbatches
from megatron.core.pipeline_parallel.utils import Step, backward_table, incoming, interleaved_table, make_plan


def simulate(pp, chunks, n_mb, group, forward_only=False):
    plans = [make_plan(pp, r, n_mb, chunks, group, forward_only) for r in range(pp)]
    inputs = [[deque() for _ in range(chunks)] for _ in range(pp)]
    grads = [[deque() for _ in range(chunks)] for _ in range(pp)]
    done_f, done_b = [set() for _ in range(pp)], [set() for _ in range(pp)]
    t_end = max(p.num_calls + r for r, p in enumerate(plans))
    for t in range(-1, t_end + 1):
        sent = []  # (dest rank, kind, chunk, microbatch)
        for r, plan in enumerate(plans):
            call = t - r
            f, b = plan.forward_at(call), plan.backward_at(call)
            if f is not None:
                if not (r == 0 and f.chunk == 0):
                    assert inputs[r][f.chunk].popleft() == f.microbatch
                done_f[r].add(f)
                if plan.sends_next(call) is not None:
                    sent.append(((r + 1) % pp, "fwd", f.chunk + (1 if r == pp - 1 else 0), f.microbatch))
            if b is not None:
                assert b in done_f[r]
                if not (r == pp - 1 and b.chunk == chunks - 1):
                    assert grads[r][b.chunk].popleft() == b.microbatch
                done_b[r].add(b)
                if plan.sends_prev(call) is not None:
                    sent.append(((r - 1) % pp, "bwd", b.chunk - (1 if r == 0 else 0), b.microbatch))
        expected = {(r, k): None for r in range(pp) for k in ("fwd", "bwd")}
        for dest, kind, chunk, mb in sent:
            assert expected[(dest, kind)] is None, "two messages of one kind in one call"
            expected[(dest, kind)] = chunk
            (inputs if kind == "fwd" else grads)[dest][chunk].append(mb)
        for r in range(pp):
            fwd_chunk, bwd_chunk = incoming(lambda q: plans[q], r, pp, t - r)
            assert (fwd_chunk, bwd_chunk) == (expected[(r, "fwd")], expected[(r, "bwd")])
    total = n_mb * chunks
    for r in range(pp):
        assert len(done_f[r]) == total
        assert len(done_b[r]) == (0 if forward_only else total)
        assert all(not d for d in inputs[r] + grads[r])


@pytest.mark.parametrize("pp,chunks,n_mb,group", [
    (2, 2, 2, 2), (2, 2, 4, 2), (2, 2, 6, 3), (4, 2, 4, 4), (4, 2, 8, 4), (4, 3, 12, 4),
    (2, 3, 6, 3), (4, 2, 10, 5), (3, 2, 6, 3), (2, 4, 2, 2), (2, 2, 8, 4),
])
def test_interleaved_plan_is_consistent(pp, chunks, n_mb, group):
    simulate(pp, chunks, n_mb, group)
    simulate(pp, chunks, n_mb, group, forward_only=True)


def test_table_order():
    table = interleaved_table(4, 2, 2)
    # groups [0,1] and [2,3], each through chunk 0 then chunk 1
    assert [(s.microbatch, s.chunk) for s in table] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert backward_table(table, 2)[0] == Step(0, 1)


def test_warmup_matches_megatron_formula():
    plan = make_plan(4, 1, 8, 2, 4, False)
    assert plan.warmup == 2 * (4 - 1 - 1) + (2 - 1) * 4
    assert make_plan(4, 0, 4, 2, 4, False).warmup == 10  # beyond the 8 steps: idle calls


def test_too_few_microbatches_rejected():
    with pytest.raises(ValueError, match=r"num_microbatches \(3\).*--global-batch-size"):
        check_interleaved_microbatches(3, 4, 4)
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) to be a multiple"):
        check_interleaved_microbatches(6, 4, 4)
    with pytest.raises(ValueError, match="microbatch-group-size"):
        check_interleaved_microbatches(8, 4, 2)
