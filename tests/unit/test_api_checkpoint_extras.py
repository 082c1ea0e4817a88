"""apply_swiglu_sharded_factory (TP=2 and DP-sharded saves loaded at TP=1) and remove_sharded_tensors."""
import os

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
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
