"""Async saves on one GPU through page-locked, reused host buffers (HostStaging):

- the time the caller is blocked is a small fraction of the device-to-host copy (which runs on a side
  stream) and of a copy into pageable memory (what an async save blocked for before);
- work queued after `wait_for_staged_copies()` (the optimizer step) runs after the copy: the checkpoint is
  byte for byte a synchronous save's of the same step, although training changed the tensors meanwhile;
- the buffers are page-locked, allocated by the first save and reused by the next.

State: ~2 GiB (core test) and a ~1.6 GB model + Adam state (save_checkpoint test). Needs a CUDA device.

    python -m pytest -q -s tests/gpu/test_async_save_gpu.py
"""
import os
import time

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.staging import HostStaging, wait_for_staged_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _state(gib=2.0, seed=0):
    """~``gib`` GiB of fp32 in 256 MiB tensors, a bf16 tensor, a small and a non-contiguous one, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = max(1, int(gib * 4))
    tensors = {f"w{i}": torch.randn(8192, 8192, device="cuda", generator=g) for i in range(n)}
    tensors["bf16"] = torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16)
    tensors["small"] = torch.randn(3, device="cuda", generator=g)
    tensors["strided"] = torch.randn(512, 256, device="cuda", generator=g).t()
    return tensors


def _sharded(tensors):
    return {"state": {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, "iteration": 1}


def _distcp(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n.endswith(".distcp")}


def _write(request):
    q = dc.AsyncCallsQueue()
    q.schedule_async_request(request)
    assert q.maybe_finalize_async_calls(blocking=True) == [0]


def _timed_save(tensors, path, staging):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    request = dc.save(_sharded(tensors), path, async_sharded_save=True, host_staging=staging)
    return request, time.perf_counter() - t0


def test_blocked_time_is_a_small_part_of_the_copy_and_the_checkpoint_equals_a_sync_save(tmp_path):
    tensors = _state()
    nbytes = sum(t.nbytes for t in tensors.values())
    # Synchronous saves: from host copies (DCP writes host tensors in plan order, as the async saves do: the
    # files compare byte for byte) and from the GPU tensors (DCP's copy-ahead loader writes them sorted by
    # size: the values compare).
    dc.save(_sharded({k: v.cpu() for k, v in tensors.items()}), str(tmp_path / "sync"))
    dc.save(_sharded(tensors), str(tmp_path / "sync_gpu"))

    # Before: a copy into fresh pageable memory, which the caller waits for.
    request, pageable_s = _timed_save(tensors, str(tmp_path / "pageable"), HostStaging(pin=False, keep=False))
    _write(request)

    staging = HostStaging()
    request, first_s = _timed_save(tensors, str(tmp_path / "first"), staging)  # allocates and pins the buffers
    alloc_s = staging.stats["alloc_s"]
    _write(request)
    assert alloc_s > 0 and staging.nbytes >= nbytes

    request, blocked_s = _timed_save(tensors, str(tmp_path / "staged"), staging)
    stats = dict(staging.stats)
    # Training goes on: the next in-place update waits for the copy on the device, not on the host.
    wait_for_staged_copies()
    for t in tensors.values():
        t.mul_(-1.0)
    _write(request)
    copy_s = staging.copy_seconds()
    print(f"\nstate {nbytes / 1e9:.2f} GB | pageable copy (old blocking path) {pageable_s:.3f} s | first pinned "
          f"save {first_s:.3f} s (allocation {alloc_s:.3f} s) | blocked {blocked_s * 1e3:.1f} ms (launch "
          f"{stats['launch_s'] * 1e3:.1f} ms) | device copy {copy_s:.3f} s = {nbytes / copy_s / 1e9:.1f} GB/s")

    assert stats["alloc_s"] == 0.0 and stats["sync_copy_s"] < 0.01  # reused buffers, nothing copied in line
    assert stats["launch_s"] < 0.25 * copy_s, (stats, copy_s)
    assert blocked_s < 0.25 * pageable_s, (blocked_s, pageable_s)
    assert _distcp(tmp_path / "staged") == _distcp(tmp_path / "sync") == _distcp(tmp_path / "pageable") \
        == _distcp(tmp_path / "first")
    want = {k: -v.cpu() for k, v in tensors.items()}  # the values at save time (negated since)
    template = _sharded({k: torch.empty_like(v) for k, v in want.items()})
    for name in ("staged", "sync_gpu"):
        got = dc.load(template, str(tmp_path / name))["state"]
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want), name

    out = staging.stage([tensors["w0"]])  # another structure: new page-locked buffers
    try:
        staging.wait_copy()
        assert out[0].is_pinned() and torch.equal(out[0], tensors["w0"].cpu())
    finally:
        staging.release()
        staging.free()


class _Net(torch.nn.Module):
    """8 x (4096 x 4096) linears: 134M fp32 params, ~1.6 GB with Adam's two moments."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4096, 4096, bias=False) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

    def sharded_state_dict(self, prefix=""):
        return {k: ShardedTensor.from_rank_offsets(prefix + k, v) for k, v in self.state_dict().items()}


def _step(model, opt):
    x = torch.randn(64, 4096, device="cuda")
    opt.zero_grad()
    (model[0](x) ** 2).mean().backward()
    opt.step()


def _model_and_optimizer():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from tests.parallel.dist_utils import free_port

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    if torch.distributed.get_backend() != "nccl":
        pytest.skip("another test initialized a non-NCCL process group in this process")
    torch.manual_seed(0)
    model = [_Net().cuda()]
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0), model)
    sched = OptimizerParamScheduler(opt, init_lr=1e-3, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=10, wd_incr_style="constant")
    return model, opt, sched


def test_buffers_reserved_in_the_background_serve_the_first_save(tmp_path):
    """What the training loop does after its first step: the first async save takes the reserved, page-locked
    buffers (no allocation while training waits) and writes the same bytes as a synchronous save."""
    from megatron.training import async_utils
    from megatron.training.checkpointing import reserve_async_save_buffers, save_checkpoint
    from megatron.training.global_vars import set_args
    from tests.unit.training.checkpointing.test_checkpointing import make_args

    model, opt, sched = _model_and_optimizer()
    shape = dict(num_layers=8, hidden_size=4096, num_attention_heads=32)
    async_args = make_args(str(tmp_path / "async"), async_save=True, **shape)
    _step(model, opt)
    set_args(async_args)
    nbytes = reserve_async_save_buffers(model, opt, sched, 1)
    staging = async_utils.host_staging()
    assert nbytes > 1.5e9 and staging._reserving is not None
    for _ in range(3):  # training goes on while the buffers are allocated and page-locked
        _step(model, opt)
    staging._reserving.join()
    reserved = staging._reserved[0].data_ptr()
    set_args(make_args(str(tmp_path / "sync"), **shape))
    save_checkpoint(1, model, opt, sched, 1.0)
    set_args(async_args)
    save_checkpoint(1, model, opt, sched, 1.0)
    stats = async_utils.last_staging_stats()
    _step(model, opt)
    async_utils.maybe_finalize_async_save(blocking=True)
    print(f"\nreserved {nbytes / 1e9:.2f} GB in {staging.reserve_s:.2f} s in the background; the first save "
          f"waited {stats['alloc_s'] * 1e3:.1f} ms for buffers")
    assert staging._slab.data_ptr() == reserved and staging._registered
    assert stats["alloc_s"] < 0.05, stats
    assert _distcp(tmp_path / "sync" / "iter_0000001") == _distcp(tmp_path / "async" / "iter_0000001")
    async_utils.maybe_finalize_async_save(terminate=True)


def test_save_checkpoint_then_optimizer_steps_write_the_step_of_the_save(tmp_path):
    from megatron.training import async_utils
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_args
    from tests.unit.training.checkpointing.test_checkpointing import make_args

    model, opt, sched = _model_and_optimizer()
    shape = dict(num_layers=8, hidden_size=4096, num_attention_heads=32)
    sync_args, async_args = make_args(str(tmp_path / "sync"), **shape), \
        make_args(str(tmp_path / "async"), async_save=True, **shape)
    blocked = []
    for it in (1, 2):  # the first async save allocates the buffers, the second reuses them
        _step(model, opt)
        set_args(sync_args)
        save_checkpoint(it, model, opt, sched, float(it))
        set_args(async_args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        save_checkpoint(it, model, opt, sched, float(it))
        blocked.append(time.perf_counter() - t0)
        stats = async_utils.last_staging_stats()
        for _ in range(3):  # steps queued right behind the copy: each waits for it on the device
            _step(model, opt)
        async_utils.maybe_finalize_async_save(blocking=True)
        name = f"iter_{it:07d}"
        assert _distcp(tmp_path / "sync" / name) == _distcp(tmp_path / "async" / name)
    copy_s = async_utils.last_staging_stats()["copy_s"]
    print(f"\nsave_checkpoint blocked {blocked[0]:.3f} s (first: allocation) then {blocked[1] * 1e3:.1f} ms; "
          f"launch {stats['launch_s'] * 1e3:.1f} ms; device copy of {stats['bytes'] / 1e9:.2f} GB {copy_s:.3f} s")
    assert stats["alloc_s"] == 0.0 and stats["launch_s"] < 0.25 * copy_s, (stats, copy_s)
    async_utils.maybe_finalize_async_save(terminate=True)
