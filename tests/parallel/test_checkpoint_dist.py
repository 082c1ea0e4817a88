"""Multi-rank dist_checkpointing: replicated shards written once, resharding between TP sizes, async."""
import os

import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from tests.parallel.dist_utils import run_distributed

FULL_W = torch.arange(48, dtype=torch.float32).reshape(8, 6)  # column-parallel: split dim 0
FULL_P = torch.arange(24, dtype=torch.float32).reshape(4, 6) * -1  # row-parallel: split dim 1
BIAS = torch.linspace(0, 1, 6)


def _sd(rank, size, zeros=False):
    f = (lambda t: torch.zeros_like(t)) if zeros else (lambda t: t.clone())
    return {
        "qkv": ShardedTensor.from_rank_offsets("qkv", f(FULL_W.chunk(size, 0)[rank]), (0, rank, size)),
        "proj": ShardedTensor.from_rank_offsets("proj", f(FULL_P.chunk(size, 1)[rank]), (1, rank, size)),
        "bias": ShardedTensor.from_rank_offsets("bias", f(BIAS), replica_id=rank),
        "rng": ShardedObject("rng", f"state-{rank}", (size,), (rank,)),
        "iteration": 3,
    }


def _save(ckpt, async_save):
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sd = _sd(rank, size)
    if async_save:
        q = dc.AsyncCallsQueue()
        q.schedule_async_request(dc.save(sd, ckpt, async_sharded_save=True))
        for v in sd.values():  # training goes on and updates params in place
            if isinstance(v, ShardedTensor):
                v.data.add_(100.0)
        q.maybe_finalize_async_calls(blocking=True)
    else:
        dc.save(sd, ckpt)
    return sorted(os.listdir(ckpt))


def _load(ckpt):
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sd = _sd(rank, size, zeros=True)
    del sd["rng"]
    out = dc.load(sd, ckpt)
    return {k: v for k, v in out.items()}


def _check(out, rank, size):
    assert torch.equal(out["qkv"], FULL_W.chunk(size, 0)[rank])
    assert torch.equal(out["proj"], FULL_P.chunk(size, 1)[rank])
    assert torch.equal(out["bias"], BIAS) and out["iteration"] == 3


def test_tp2_save_loads_at_tp1_and_tp2(tmp_path):
    ckpt = str(tmp_path / "c")
    files = run_distributed(_save, 2, ckpt, False)[0]
    assert "__0_0.distcp" in files and "__1_0.distcp" in files and "metadata.json" in files
    _check(dc.load(_sd(0, 1, zeros=True) | {"rng": ShardedObject("rng", None, (2,), (1,))}, ckpt), 0, 1)
    assert dc.load({"rng": ShardedObject("rng", None, (2,), (1,))}, ckpt)["rng"] == "state-1"
    for r, out in enumerate(run_distributed(_load, 2, ckpt)):
        _check(out, r, 2)


def test_tp1_async_save_loads_at_tp2(tmp_path):
    ckpt = str(tmp_path / "c")
    sd = _sd(0, 1)
    q = dc.AsyncCallsQueue()
    q.schedule_async_request(dc.save(sd, ckpt, async_sharded_save=True))
    q.close()
    for r, out in enumerate(run_distributed(_load, 2, ckpt)):
        _check(out, r, 2)


def test_async_two_ranks_equals_sync(tmp_path):
    a, s = str(tmp_path / "a"), str(tmp_path / "s")
    run_distributed(_save, 2, a, True)
    run_distributed(_save, 2, s, False)
    meta_a, meta_s = dc.load_tensors_metadata(a), dc.load_tensors_metadata(s)
    assert meta_a == meta_s
    tgt = _sd(0, 1, zeros=True)
    del tgt["rng"]
    la, ls = dc.load(tgt, a), dc.load(tgt, s)
    for k in ("qkv", "proj", "bias"):
        assert torch.equal(la[k], ls[k])
    _check(la, 0, 1)


def _tagged_all_reduce(value, delay, results, key, group=None):
    """A write stand-in: one collective on the queue's group (``delay`` makes this rank reach it late)."""
    import time
    time.sleep(delay)
    t = torch.tensor([float(value)])
    torch.distributed.all_reduce(t, group=group)
    results[key] = t.item()


def _two_pending_writes():
    rank = torch.distributed.get_rank()
    out = []
    for persistent in (False, True):  # a worker per save, or one persistent worker
        q, results = dc.AsyncCallsQueue(persistent=persistent), {}
        # Were both writes in flight at once, rank 0 would reach b's collective first and rank 1 a's, so
        # they would pair up on the shared group (a == b == 11).
        q.schedule_async_request(dc.AsyncRequest(_tagged_all_reduce, (1, 0.5 if rank == 0 else 0.0, results, "a")))
        q.schedule_async_request(dc.AsyncRequest(_tagged_all_reduce, (10, 0.0 if rank == 0 else 0.2, results, "b")))
        out.append((q.maybe_finalize_async_calls(blocking=True), results))
        q.close()
    return out


def test_async_writes_run_in_schedule_order():
    """Back-to-back saves: each write's collectives run after the previous write's, on every rank."""
    for per_rank in run_distributed(_two_pending_writes, 2):
        for done, results in per_rank:
            assert done == [0, 1] and results == {"a": 2.0, "b": 20.0}


def _padded_load(ckpt, bad_rank):
    """Load the saved (4,) tensor 'a' as (6,) split over 2 ranks (rank 1's chunk ends past the saved
    shape); `bad_rank` gives its chunk twice, a request that fails on that rank alone."""
    rank = torch.distributed.get_rank()
    chunk = ShardedTensor.from_rank_offsets("a", torch.full((3,), 3.7e19), (0, rank, 2), allow_shape_mismatch=True)
    request = {"a": chunk}
    if rank == bad_rank:
        request["again"] = ShardedTensor.from_rank_offsets("a", torch.zeros(3), (0, rank, 2), allow_shape_mismatch=True)
    try:
        result = dc.load(request, ckpt)["a"].tolist()
    except dc.CheckpointingException as e:
        result = str(e)
    torch.distributed.barrier()  # a rank left behind in a collective would hang here
    return result


def test_allow_shape_mismatch_zero_pads_and_a_failing_rank_fails_all(tmp_path):
    ckpt = str(tmp_path / "c")
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(4))}, ckpt)
    assert run_distributed(_padded_load, 2, ckpt, None, timeout=60) == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    errors = run_distributed(_padded_load, 2, ckpt, 1, timeout=60)
    assert errors[0] == errors[1] and errors[0].startswith(f"load of {ckpt} failed on rank 1: ShardedTensor a at ")
    assert "\n" not in errors[0]
