"""Megatron's dist_checkpointing names: apply_swiglu_sharded_factory (TP=2 and DP-sharded saves loaded at
TP=1), remove_sharded_tensors, LocalNonpersistentObject, the torch_dist strategy objects, factories,
validation and integrity checks, MCoreMetadata unpickling, the async callers, and the refusal of an
incomplete sharding."""
import os

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import remove_sharded_tensors as remove_from_serialization
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from tests.parallel.dist_utils import run_distributed

FFN, H = 4, 3


def _gate_up():
    g = torch.Generator().manual_seed(0)
    return torch.randn(FFN, H, generator=g), torch.randn(FFN, H, generator=g)


def _save_tp2(ckpt):
    """Each of 2 ranks holds [gate_r; up_r] (a column-parallel fused fc1) and saves it three ways."""
    rank = torch.distributed.get_rank()
    gate, up = _gate_up()
    local = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])  # [2 * FFN / 2, H]
    tp = lambda key: ShardedTensor.from_rank_offsets(key, local.clone(), (0, rank, 2))  # noqa: E731
    # Per-layer stacking: a prepended axis of 1 layer.
    stacked = ShardedTensor.from_rank_offsets("stacked", local.clone(), (0, 0, 1), (1, rank, 2), prepend_axis_num=1)
    # FSDP2 over 2 DP ranks at TP=1: rank 0 holds the whole gate, rank 1 the whole up.
    dp_local = torch.cat([gate, up]).chunk(2)[rank].clone()
    dp = ShardedTensor.from_rank_offsets("dp", dp_local, (0, rank, 2))
    dp.is_torch_fsdp2_param = True
    tp_group = [torch.distributed.new_group([r]) for r in range(2)][rank]
    sd = {
        "fc1": apply_swiglu_sharded_factory(tp("fc1"), ()),
        "single": apply_swiglu_sharded_factory(tp("single"), (), singleton_local_shards=True),
        "stacked": apply_swiglu_sharded_factory(stacked, ((0, 0, 1),)),
        "dp": apply_swiglu_sharded_factory(dp, (), tp_group=tp_group, dp_group=torch.distributed.group.WORLD),
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", local.clone(), (0, rank, 2))},
        "iteration": 5,
    }
    dc.save(sd, ckpt)


def test_swiglu_factory_reshards_and_remove_sharded_tensors(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_tp2, 2, ckpt)
    gate, up = _gate_up()
    full = torch.cat([gate, up])
    # Megatron's global layout: [gate; up] whole, or gate / up under key_w / key_v.
    plain = dc.load_plain_tensors(ckpt)
    assert torch.equal(plain["fc1"], full) and torch.equal(plain["dp"], full)
    assert torch.equal(plain["single_w"], gate) and torch.equal(plain["single_v"], up)
    assert torch.equal(plain["stacked"][0], full)
    # TP=1 through the factories: the merge gives the fused [gate; up] back.
    one = lambda key: ShardedTensor.from_rank_offsets(key, torch.zeros(2 * FFN, H))  # noqa: E731
    target = {"fc1": apply_swiglu_sharded_factory(one("fc1"), ()),
              "single": apply_swiglu_sharded_factory(one("single"), (), singleton_local_shards=True)}
    out = dc.load(target, ckpt)
    assert torch.equal(out["fc1"], full) and torch.equal(out["single"], full) and out["iteration"] == 5

    # Dropping the optimizer state: the rest loads unchanged, the dropped key is gone, other files stay.
    os.makedirs(os.path.join(ckpt, "extra"))
    open(os.path.join(ckpt, "extra", "note.txt"), "w").write("kept")
    size_before = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    dc.remove_sharded_tensors(ckpt, "optimizer.")
    assert "optimizer.exp_avg" not in dc.load_tensors_metadata(ckpt)
    assert sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)) < size_before
    after = dc.load_plain_tensors(ckpt)
    assert set(after) == set(plain) - {"optimizer.exp_avg"}
    assert all(torch.equal(after[k], plain[k]) for k in after)
    assert dc.load_common_state_dict(ckpt)["iteration"] == 5
    assert open(os.path.join(ckpt, "extra", "note.txt")).read() == "kept"
    with pytest.warns(UserWarning, match="no entries"):
        remove_from_serialization(ckpt, "optimizer.")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind


def test_remove_sharded_tensors_failure_keeps_original(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "c")
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
             "b": ShardedTensor.from_rank_offsets("b", torch.zeros(3))}, ckpt)
    before = sorted(os.listdir(ckpt))
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    def fail(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(strategy, "dcp_write", fail)
    with pytest.raises(OSError, match="disk full"):
        dc.remove_sharded_tensors(ckpt, "b")
    assert sorted(os.listdir(ckpt)) == before and sorted(os.listdir(tmp_path)) == ["c"]
    assert set(dc.load_plain_tensors(ckpt)) == {"a", "b"}
    with pytest.raises(dc.CheckpointingException, match="does not exist"):
        dc.remove_sharded_tensors(str(tmp_path / "missing"), "a")


def test_local_nonpersistent_object_is_not_saved_and_comes_back_local(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
    ckpt = str(tmp_path / "ckpt")
    w = torch.arange(4.0)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w), "it": LocalNonpersistentObject(5),
                             "n": [1, LocalNonpersistentObject("x")]}, ckpt)
    common = dist_checkpointing.load_common_state_dict(ckpt)
    assert common["it"] is None and common["n"] == [1, None]  # the wrapped values never reach disk
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4)),
                                   "it": LocalNonpersistentObject(7), "n": [1, LocalNonpersistentObject("y")]}, ckpt)
    assert out["it"] == 7 and out["n"] == [1, "y"] and torch.equal(out["w"], w)


def test_torch_dist_strategy_objects_save_and_load(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )
    ckpt = str(tmp_path / "ckpt")
    w = torch.arange(6.0).view(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w)}, ckpt,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2))
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, ckpt,
                                  sharded_strategy=get_default_load_sharded_strategy(ckpt))
    assert torch.equal(out["w"], w)
    assert isinstance(get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    with pytest.raises(NotImplementedError, match="cpu_shm_mode"):
        TorchDistSaveShardedStrategy(cpu_shm_mode=True)
    with pytest.raises(ValueError, match="sharded_strategy"):
        dist_checkpointing.load({}, ckpt, sharded_strategy="zarr")
    assert isinstance(TorchDistLoadShardedStrategy(cache_metadata=True), TorchDistLoadShardedStrategy)


def _swiglu_factory(key, w):
    """Megatron's use of factories: a fused [gate; up] weight saved as two tensors."""
    def build(k, t, replica_id, flattened_range):
        gate, up = t.chunk(2)
        return {"gate": ShardedTensor.from_rank_offsets(k + ".gate", gate, replica_id=replica_id),
                "up": ShardedTensor.from_rank_offsets(k + ".up", up, replica_id=replica_id)}

    return dc.ShardedTensorFactory(key, w, build, lambda sub: torch.cat([sub["gate"], sub["up"]]))


def test_factory_round_trip_validation_and_integrity(tmp_path):
    from megatron.core.dist_checkpointing import validation as V
    ckpt = str(tmp_path / "c")
    w = torch.randn(6, 3)
    dc.save({"w": _swiglu_factory("fc1", w), "rng": ShardedObject("rng", 5, (1,), (0,))}, ckpt,
            verify_integrity=True)
    assert set(dc.load_tensors_metadata(ckpt)) == {"fc1.gate", "fc1.up"}
    meta = dc.load_sharded_metadata(ckpt)
    assert meta["fc1.up"].global_shape == (3, 3) and meta["rng/shard_0_1"].key == "rng"
    out = dc.load({"w": _swiglu_factory("fc1", torch.empty(6, 3)), "rng": ShardedObject("rng", None, (1,), (0,))},
                  ckpt, verify_integrity=True)
    assert torch.equal(out["w"], w) and out["rng"] == 5
    # Coverage check: two main replicas of one chunk, or a missing chunk, are invalid.
    halves = [ShardedTensor.from_rank_offsets("t", torch.zeros(2), (0, r, 2)) for r in range(2)]
    V.validate_sharding_integrity([[halves[0]], [halves[1]]])
    with pytest.raises(dc.CheckpointingException):
        V.validate_sharding_integrity([[halves[0]], [halves[0]]])
    sd, missing, unexpected = V.validate_integrity_and_strict_load(
        {"a": ShardedTensor.from_rank_offsets("nope", torch.zeros(1))}, V.StrictHandling.RETURN_ALL, False,
        global_metadata=[[]], ckpt_sharded_metadata=meta)
    assert sd == {} and unexpected == {"nope"} and missing == {"fc1.gate", "fc1.up", "rng"}
    with open(os.path.join(ckpt, "common.pt"), "ab") as f:
        f.write(b"x")
    with pytest.raises(dc.CheckpointingException, match="common.pt"):
        V.verify_integrity_manifest(ckpt)


def test_megatron_metadata_class_unpickles(tmp_path):
    """A .metadata pickled as Megatron Core 0.15's MCoreMetadata (optimizer-state checkpoints) loads."""
    import pickle

    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata
    ckpt = str(tmp_path / "c")
    w = torch.randn(4, 2)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, ckpt)
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    legacy = MCoreMetadata()
    legacy.__dict__.update(vars(md))
    with open(path, "wb") as f:
        pickle.dump(legacy, f)
    assert torch.equal(dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 2))}, ckpt)["w"], w)


def test_async_callers_single_process():
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncRequest,
        PersistentAsyncCaller,
        TemporalAsyncCaller,
    )
    order = []
    for caller in (TemporalAsyncCaller(), PersistentAsyncCaller()):
        for tag in ("a", "b"):
            caller.schedule_async_call(AsyncRequest(order.append, (tag,)))
            assert caller.is_current_async_call_done(blocking=True, no_dist=True)
        caller.close()
    assert order == ["a", "b", "a", "b"]
    # Megatron's field order: (fn, args, finalize_fns, kwargs); preload_fn's result becomes args[1].
    got = []
    request = AsyncRequest(lambda a, b, k=0: got.append((a, b, k)), (1, 2), [], {"k": 5}, lambda: 9).freeze()
    request.execute_sync()
    assert got == [(1, 9, 5)]
    with pytest.raises(RuntimeError, match="frozen"):
        request.add_finalize_fn(print)


def test_save_refuses_an_incomplete_sharding(tmp_path):
    """One of two chunks described (validate_access_integrity, on by default): nothing is written."""
    half = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2))
    with pytest.raises(dc.CheckpointingException, match="w"):
        dc.save({"w": half}, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c" / ".metadata")
    dc.save({"w": half}, str(tmp_path / "d"), validate_access_integrity=False)  # the caller's call
