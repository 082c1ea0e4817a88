"""Async saves: a queued request writes what a sync save writes; a failed request is not finalized."""
import torch

from megatron.core import dist_checkpointing as dc
from tests.unit.core.dist_checkpointing.test_serialization import _sharded_sd


def _full(key_seed, shape):
    g = torch.Generator().manual_seed(key_seed)
    return torch.randn(*shape, generator=g)


def test_async_request_matches_sync(tmp_path):
    w, b = _full(0, (8, 4)), _full(1, (4,))
    sd = _sharded_sd(0, 1, w, b)
    dc.save(sd, str(tmp_path / "sync"))
    req = dc.save(sd, str(tmp_path / "async"), async_sharded_save=True)
    sd["layer"]["weight"].data.add_(1.0)  # the request holds a host copy taken at save time
    assert not dc.check_is_distributed_checkpoint(str(tmp_path / "async"))
    q = dc.AsyncCallsQueue()
    q.schedule_async_request(req)
    assert q.maybe_finalize_async_calls(blocking=True) == [0]
    tgt = _sharded_sd(0, 1, torch.zeros(8, 4), torch.zeros(4))
    a, s = dc.load(tgt, str(tmp_path / "async")), dc.load(tgt, str(tmp_path / "sync"))
    assert torch.equal(a["layer"]["weight"], s["layer"]["weight"])
    assert torch.equal(a["layer"]["weight"], w)


def test_failed_async_request_is_not_finalized(tmp_path, capsys):
    def boom(group=None):
        raise OSError("disk full")
    done = []
    q = dc.AsyncCallsQueue()
    q.schedule_async_request(dc.AsyncRequest(boom, finalize_fns=[lambda: done.append(1)], description="x"))
    assert q.maybe_finalize_async_calls(blocking=True) == []
    assert done == [] and q.failed == ["x"]
    assert "disk full" in capsys.readouterr().out
