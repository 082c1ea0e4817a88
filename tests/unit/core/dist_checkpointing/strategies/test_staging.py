"""HostStaging: reusable host buffers of async saves. On CPU the copies are plain copies; a checkpoint
written from the buffers is byte for byte the one a synchronous save writes."""
import os
import pickle

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.staging import HostStaging, wait_for_staged_copies


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
            torch.randint(0, 100, (2, 2, 3), generator=g), torch.tensor(2.5), torch.empty(0, 4),
            torch.randn(6, 4, generator=g).t()]  # a non-contiguous source


def test_stage_copies_and_reuses_the_buffers():
    staging = HostStaging()
    src = _tensors()
    out = staging.stage(src)
    # Shape, dtype and strides as `.to("cpu")` gives them (the transposed source stays transposed).
    assert [(o.shape, o.dtype, o.stride()) for o in out] == [(s.shape, s.dtype, s.cpu().stride()) for s in src]
    assert not out[-1].is_contiguous()
    assert all(torch.equal(o, s) for o, s in zip(out, src))
    # Each buffer owns exactly its bytes: DCP's writer would copy a tensor with a larger storage first.
    assert all(o.untyped_storage().nbytes() == o.nbytes for o in out)
    ptrs, size = [o.data_ptr() for o in out if o.numel()], staging.nbytes
    assert size >= sum(s.nbytes for s in src)
    with pytest.raises(RuntimeError, match="release"):
        staging.stage(src)  # the previous save was not written yet
    for s in src:
        s.add_(1) if s.dtype != torch.int64 else s.add_(3)
    assert not torch.equal(out[0], src[0])  # a copy, not an alias
    staging.release()
    again = staging.stage(src)
    assert [o.data_ptr() for o in again if o.numel()] == ptrs and staging.nbytes == size  # same memory
    assert all(torch.equal(o, s) for o, s in zip(again, src))
    assert staging.stats["alloc_s"] == 0.0 and staging.stats["bytes"] == sum(s.nbytes for s in src)
    staging.release()
    bigger = staging.stage([torch.ones(100, 10)])  # another structure: new buffers of its size
    assert torch.equal(bigger[0], torch.ones(100, 10)) and staging.nbytes >= 4000
    staging.release()
    staging.free()
    assert staging.nbytes == 0
    wait_for_staged_copies()  # nothing pending on CPU


def test_not_kept_buffers_are_freed_after_the_write():
    staging = HostStaging(pin=False, keep=False)
    out = staging.stage(_tensors())
    assert staging.nbytes > 0 and torch.equal(out[0], _tensors()[0])
    staging.release()
    assert staging.nbytes == 0 and torch.equal(out[0], _tensors()[0])  # the writer's references stay valid


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(16, 8, generator=g), torch.randn(8, generator=g).to(torch.bfloat16)
    return {"layer": {"weight": ShardedTensor.from_rank_offsets("layer.weight", w),
                      "bias": ShardedTensor.from_rank_offsets("layer.bias", b)},
            "opt": {"exp_avg": ShardedTensor.from_rank_offsets("opt.exp_avg", torch.randn(16, 8, generator=g)),
                    "t": ShardedTensor.from_rank_offsets("opt.t", torch.randn(6, 4, generator=g).t()),
                    "cols": ShardedTensor.from_rank_offsets("opt.cols", torch.randn(6, 8, generator=g)[:, 2:5])},
            "rng": ShardedObject("rng", {"seed": seed}, (1,), (0,)), "iteration": seed}


def _files(d):
    """{name: bytes} of a checkpoint; DCP's `.metadata` unpickled without its per-save random id."""
    out = {}
    for name in sorted(os.listdir(d)):
        data = open(os.path.join(d, name), "rb").read()
        if name == ".metadata":
            md = pickle.loads(data)
            data = (md.state_dict_metadata, md.storage_data, md.planner_data)
        out[name] = data
    return out


def _run(request):
    q = dc.AsyncCallsQueue()
    q.schedule_async_request(request)
    assert q.maybe_finalize_async_calls(blocking=True) == [0]


def test_staged_async_save_equals_a_sync_save_bitwise(tmp_path):
    staging = HostStaging()
    sd = _state(1)
    dc.save(sd, str(tmp_path / "sync"))
    request = dc.save(_state(1), str(tmp_path / "staged"), async_sharded_save=True, host_staging=staging)
    sd2 = _state(2)  # the next save may not reuse the buffers before this one is written
    with pytest.raises(RuntimeError, match="release"):
        dc.save(sd2, str(tmp_path / "too_early"), async_sharded_save=True, host_staging=staging)
    _run(request)
    assert _files(tmp_path / "sync") == _files(tmp_path / "staged")
    # The buffers are reused by the next save; the first checkpoint stays as written.
    size = staging.nbytes
    dc.save(_state(2), str(tmp_path / "sync2"))
    _run(dc.save(_state(2), str(tmp_path / "staged2"), async_sharded_save=True, host_staging=staging))
    assert staging.nbytes == size
    assert _files(tmp_path / "sync2") == _files(tmp_path / "staged2")
    assert _files(tmp_path / "sync") == _files(tmp_path / "staged")
    loaded = dc.load(_state(0), str(tmp_path / "staged"))
    assert torch.equal(loaded["layer"]["weight"], _state(1)["layer"]["weight"].data)


def test_staged_save_holds_the_values_of_the_save_time(tmp_path):
    staging = HostStaging()
    sd = _state(3)
    want = sd["layer"]["weight"].data.clone()
    request = dc.save(sd, str(tmp_path / "a"), async_sharded_save=True, host_staging=staging)
    sd["layer"]["weight"].data.mul_(-1)  # training goes on before the write
    _run(request)
    assert torch.equal(dc.load(_state(0), str(tmp_path / "a"))["layer"]["weight"], want)


def test_write_error_inside_dcp_releases_the_buffers(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    staging = HostStaging()
    request = dc.save(_state(1), str(tmp_path / "a"), async_sharded_save=True, host_staging=staging)

    def full(*a, **kw):
        raise OSError("No space left on device")
    monkeypatch.setattr(torch_strategy, "dcp_write", full)
    q = dc.AsyncCallsQueue()
    q.schedule_async_request(request)
    assert q.maybe_finalize_async_calls(blocking=True) == []
    assert q.failed == [str(tmp_path / "a")]
    staging.stage([torch.ones(2)])  # released by the failed write


def test_host_staging_needs_an_async_save(tmp_path):
    with pytest.raises(ValueError, match="async_sharded_save"):
        dc.save(_state(1), str(tmp_path / "a"), host_staging=HostStaging())


@pytest.fixture
def fake_page_lock(monkeypatch):
    """Page-locking without CUDA: every registration succeeds and is recorded, as are the unregistrations."""
    log = {"registered": [], "unregistered": []}

    def register(slab):
        log["registered"].append(slab.data_ptr())
        return True
    monkeypatch.setattr(HostStaging, "_register", staticmethod(register))
    monkeypatch.setattr(HostStaging, "_unregister",
                        staticmethod(lambda slab, registered: log["unregistered"].append(slab.data_ptr())))
    return log


def test_a_reservation_becomes_the_first_saves_buffers(tmp_path, fake_page_lock):
    """The save's bytes, reserved in the background while training runs, are the buffers the first save takes;
    staged_bytes sizes the reservation as the save stages (here exactly: one process, no replicas)."""
    need = dc.staged_bytes(_state(1))
    staging = HostStaging(pin=True)
    staging.reserve(need)
    staging._reserving.join()
    reserved = staging._reserved[0].data_ptr()
    assert staging.reserve_s is not None and fake_page_lock["registered"] == [reserved]
    _run(dc.save(_state(1), str(tmp_path / "staged"), async_sharded_save=True, host_staging=staging))
    assert staging._slab.data_ptr() == reserved and staging.nbytes == need and staging.stats["bytes"] > 0
    dc.save(_state(1), str(tmp_path / "sync"))
    assert _files(tmp_path / "sync") == _files(tmp_path / "staged")
    assert fake_page_lock["unregistered"] == []
    staging.free()
    assert fake_page_lock["unregistered"] == [reserved]


def test_a_reservation_too_small_is_given_back(fake_page_lock):
    src = _tensors()
    staging = HostStaging(pin=True)
    staging.reserve(HostStaging.bytes_for(src) - 512)
    out = staging.stage(src)
    assert len(fake_page_lock["unregistered"]) == 1  # the small one
    assert staging.nbytes == HostStaging.bytes_for(src) and all(torch.equal(o, s) for o, s in zip(out, src))
    staging.release()
    staging.free()


def test_no_reservation_without_page_locking_and_free_waits_for_one(fake_page_lock):
    pageable = HostStaging(pin=False)
    pageable.reserve(1 << 20)
    assert pageable._reserving is None  # a pageable allocation is fast: nothing to do ahead of time
    staging = HostStaging(pin=True)
    staging.reserve(1 << 20)
    staging.free()  # joins the thread and gives the reservation back
    assert staging._reserving is None and len(fake_page_lock["unregistered"]) == 1


def test_a_deferred_host_copy_writes_the_tensors_as_they_are_when_the_request_runs(tmp_path):
    """defer_host_copy (the synchronous save's request): the same bytes as a plain save, no host copy made up
    front (so a change before the request runs is what gets written), and refused where it cannot apply."""
    dc.save(_state(1), str(tmp_path / "sync"))
    _run(dc.save(_state(1), str(tmp_path / "deferred"), async_sharded_save=True, defer_host_copy=True))
    assert _files(tmp_path / "sync") == _files(tmp_path / "deferred")
    sd = _state(1)
    request = dc.save(sd, str(tmp_path / "late"), async_sharded_save=True, defer_host_copy=True)
    sd["layer"]["weight"].data.mul_(-1)
    _run(request)
    assert torch.equal(dc.load(_state(0), str(tmp_path / "late"))["layer"]["weight"], sd["layer"]["weight"].data)
    with pytest.raises(ValueError, match="defer_host_copy"):
        dc.save(_state(1), str(tmp_path / "a"), defer_host_copy=True)
    with pytest.raises(ValueError, match="defer_host_copy"):
        dc.save(_state(1), str(tmp_path / "b"), async_sharded_save=True, defer_host_copy=True,
                host_staging=HostStaging())
