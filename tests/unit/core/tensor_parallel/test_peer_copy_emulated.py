"""peer_copy's block bookkeeping on CPU: each TP rank is a thread, its symmetric-memory slot a CPU buffer every
thread can read, the barrier a threading.Barrier and a copy-engine transfer a synchronous copy. What this checks
is which rows go where (the gathered tensor living in the slot, the peers' blocks of a product written straight
into it, the sums in ring order) against the plain all-gather / reduce-scatter, for 2 and 4 ranks and over
operations back to back, a gathered tensor read after the group's next operation as the backward does. The
stream ordering itself is the GPU test's (tests/gpu/test_tp_comm_overlap_gpu.py)."""
import threading

import pytest
import torch

from megatron.core.tensor_parallel import peer_copy


class _Event:
    pass


class _Stream:
    def wait_event(self, event):
        assert isinstance(event, _Event)


class _FakeWorkspace:
    """The _Workspace interface over CPU buffers shared by the threads of one emulated group."""

    def __init__(self, rank, size, buffers, barrier, slot_bytes):
        self.rank, self.size, self.buffers, self.barrier, self.slot_bytes = rank, size, buffers, barrier, slot_bytes
        self.count = 0

    def begin(self, nbytes):
        assert nbytes <= self.slot_bytes
        offset = (self.count % 2) * self.slot_bytes
        self.count += 1

        def peer(rank, shape, dtype):
            n = 1
            for s in shape:
                n *= s
            return self.buffers[rank][offset:offset + n * dtype.itemsize].view(dtype).view(shape)
        return self.buffers[self.rank][offset:offset + nbytes], peer

    def exchange(self):
        self.barrier.wait()

    def copy(self, dst, src):
        dst.copy_(src)
        return _Event()


def _run(n, body):
    """body(rank) on n threads sharing one emulated group; returns the per-rank results."""
    slot = 1 << 20
    buffers = [torch.full((2 * slot,), 255, dtype=torch.uint8) for _ in range(n)]  # garbage where unwritten
    barrier = threading.Barrier(n)
    local = threading.local()
    results, errors = [None] * n, []

    def workspace(group, nbytes, device):
        return local.ws

    def target(rank):
        local.ws = _FakeWorkspace(rank, n, buffers, barrier, slot)
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()
    mp = pytest.MonkeyPatch()
    mp.setattr(peer_copy, "workspace", workspace)
    mp.setattr(peer_copy.dist, "get_world_size", lambda group=None: n)
    mp.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    try:
        threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        mp.undo()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("n", [2, 4])
def test_transfers_equal_the_plain_collectives(n):
    m, k, out_f = 3, 5, 4
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, 2, k, generator=g, dtype=torch.float64) for _ in range(n)]  # each rank's rows
    bigs = [torch.randn(n * m, 2, k, generator=g, dtype=torch.float64) for _ in range(n)]  # each rank's full input
    w = torch.randn(k, out_f, generator=g, dtype=torch.float64)
    gathered = torch.cat(xs)
    product_sum = sum(b @ w for b in bigs)  # reduce-scatter of the products: rank r gets its rows of this
    plain_sum = sum(bigs)

    def body(r):
        out = {}
        y, total = peer_copy.all_gather_mm(xs[r], w, None)
        out["ag_mm"], out["ag_total"] = y.clone(), total.clone()
        out["mm_rs"] = peer_copy.mm_reduce_scatter(bigs[r], w, None)
        # The column linear's backward: the gather's total is read after the next operation has started.
        total2, wait = peer_copy.all_gather_start(xs[r], None)
        finish = peer_copy.mm_reduce_scatter_start(bigs[r], w, None)
        wait()
        out["ag_start"] = total2.clone()
        out["mm_rs_start"] = finish()
        out["rs_start"] = peer_copy.reduce_scatter_start(bigs[r], None)()
        y3, _ = peer_copy.all_gather_mm(xs[r] * 2, w, None)  # a third operation: the first slot again
        out["ag_mm_again"] = y3
        return out

    results = _run(n, body)
    for r, res in enumerate(results):
        rows = slice(r * m, (r + 1) * m)
        torch.testing.assert_close(res["ag_total"], gathered, rtol=0, atol=0)
        torch.testing.assert_close(res["ag_start"], gathered, rtol=0, atol=0)
        torch.testing.assert_close(res["ag_mm"], gathered @ w)
        torch.testing.assert_close(res["ag_mm_again"], (gathered * 2) @ w)
        torch.testing.assert_close(res["mm_rs"], product_sum[rows])
        torch.testing.assert_close(res["mm_rs_start"], product_sum[rows])
        torch.testing.assert_close(res["rs_start"], plain_sum[rows])
