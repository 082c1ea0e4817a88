"""Single-process dist_checkpointing: round trips, resharding of synthetic shards, bad inputs."""
import json
import os

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor


def _full(key_seed, shape):
    g = torch.Generator().manual_seed(key_seed)
    return torch.randn(*shape, generator=g)


def _sharded_sd(tp_rank, tp_size, full_w, full_b):
    """A column-parallel weight split along dim 0, a replicated bias, an object and common state."""
    w = full_w.chunk(tp_size, dim=0)[tp_rank].clone()
    return {
        "layer": {
            "weight": ShardedTensor.from_rank_offsets("layer.weight", w, (0, tp_rank, tp_size)),
            "bias": ShardedTensor.from_rank_offsets("layer.bias", full_b.clone(), replica_id=tp_rank),
        },
        "rng": ShardedObject("rng", {"tp": tp_rank}, (tp_size,), (tp_rank,)),
        "iteration": 7,
        "lst": [1, "two"],
    }


def test_round_trip_and_layout(tmp_path):
    w, b = _full(0, (8, 4)), _full(1, (4,))
    ckpt = str(tmp_path / "c")
    dc.save(_sharded_sd(0, 1, w, b), ckpt)
    assert os.path.isfile(os.path.join(ckpt, ".metadata"))
    assert json.load(open(os.path.join(ckpt, "metadata.json")))["sharded_backend"] == "torch_dist"
    assert dc.check_is_distributed_checkpoint(ckpt)
    target = _sharded_sd(0, 1, torch.zeros_like(w), torch.zeros_like(b))
    out = dc.load(target, ckpt)
    assert torch.equal(out["layer"]["weight"], w) and torch.equal(out["layer"]["bias"], b)
    assert out["rng"] == {"tp": 0} and out["iteration"] == 7 and out["lst"] == [1, "two"]
    meta = dc.load_tensors_metadata(ckpt)
    assert (meta["layer.weight"].global_shape, meta["layer.weight"].dtype) == ((8, 4), torch.float32)


def test_load_slices_as_another_tp(tmp_path):
    """Saved at TP=1, each TP=4 rank's request reads exactly its slice (the reshard mechanism)."""
    w, b = _full(0, (8, 4)), _full(1, (4,))
    ckpt = str(tmp_path / "c")
    dc.save(_sharded_sd(0, 1, w, b), ckpt)
    for r in range(4):
        sd = _sharded_sd(r, 4, torch.zeros_like(w), torch.zeros_like(b))
        del sd["rng"]  # saved as one copy at TP=1
        out = dc.load(sd, ckpt)
        assert torch.equal(out["layer"]["weight"], w.chunk(4)[r])
        assert torch.equal(out["layer"]["bias"], b)


def test_load_reads_into_the_requested_tensors(tmp_path):
    """A request whose tensor has the chunk's shape and dtype is read in place (a live param, even one that
    requires grad): no second copy of the state on the device while loading."""
    w, b = _full(0, (8, 4)), _full(1, (4,))
    ckpt = str(tmp_path / "c")
    dc.save(_sharded_sd(0, 1, w, b), ckpt)
    live_w = torch.nn.Parameter(torch.zeros(4, 4))
    target = _sharded_sd(0, 2, torch.zeros_like(w), torch.zeros_like(b))
    target["layer"]["weight"] = ShardedTensor.from_rank_offsets("layer.weight", live_w, (0, 0, 2))
    del target["rng"]
    out = dc.load(target, ckpt)
    assert out["layer"]["weight"].data_ptr() == live_w.data_ptr() and torch.equal(live_w.detach(), w[:4])
    assert live_w.requires_grad and torch.equal(out["layer"]["bias"], b)


def test_a_padded_vocabulary_saved_at_its_own_shape_is_read_in_place(tmp_path):
    """allow_shape_mismatch (the padded embedding and output layer): read in place when the saved shape is the
    requested one; into a zeroed buffer, leaving the live tensor as it was, when the checkpoint is smaller."""
    ckpt = str(tmp_path / "c")
    w = _full(0, (6, 4))
    dc.save({"emb": ShardedTensor.from_rank_offsets("emb", w)}, ckpt)
    live = torch.nn.Parameter(torch.full((6, 4), -1.0))
    out = dc.load({"emb": ShardedTensor.from_rank_offsets("emb", live, allow_shape_mismatch=True)}, ckpt)["emb"]
    assert out.data_ptr() == live.data_ptr() and torch.equal(live.detach(), w)
    bigger = torch.nn.Parameter(torch.full((8, 4), -1.0))
    out = dc.load({"emb": ShardedTensor.from_rank_offsets("emb", bigger, allow_shape_mismatch=True)}, ckpt)["emb"]
    assert out.data_ptr() != bigger.data_ptr() and torch.equal(bigger.detach(), torch.full((8, 4), -1.0))
    assert torch.equal(out[:6], w) and torch.equal(out[6:], torch.zeros(2, 4))


def test_prepend_axis_and_dtype(tmp_path):
    """Per-layer tensors stacked along a prepended axis; loading casts to the requested dtype."""
    ckpt = str(tmp_path / "c")
    layers = [torch.full((2, 3), float(i)) for i in range(3)]
    sd = {f"l{i}": ShardedTensor.from_rank_offsets("stack", t, (0, i, 3), prepend_axis_num=1)
          for i, t in enumerate(layers)}
    dc.save(sd, ckpt)
    assert dc.load_tensors_metadata(ckpt)["stack"].global_shape == (3, 2, 3)
    tgt = {f"l{i}": ShardedTensor.from_rank_offsets("stack", torch.zeros(2, 3, dtype=torch.float64), (0, i, 3),
                                                    prepend_axis_num=1) for i in range(3)}
    out = dc.load(tgt, ckpt)
    for i in range(3):
        assert out[f"l{i}"].dtype == torch.float64 and torch.equal(out[f"l{i}"], layers[i].double())


def test_bad_inputs(tmp_path):
    w, b = _full(0, (8, 4)), _full(1, (4,))
    ckpt = str(tmp_path / "c")
    with pytest.raises(dc.CheckpointingException, match="no metadata.json"):
        dc.load(_sharded_sd(0, 1, w, b), ckpt)
    dc.save(_sharded_sd(0, 1, w, b), ckpt)
    with pytest.raises(dc.CheckpointingException, match="already holds a checkpoint"):
        dc.save(_sharded_sd(0, 1, w, b), ckpt)
    wrong = {"x": ShardedTensor.from_rank_offsets("layer.weight", torch.zeros(8, 5))}
    with pytest.raises(dc.CheckpointingException, match=r"global shape \(8, 4\).*expects \(8, 5\)"):
        dc.load(wrong, ckpt)
    missing = {"x": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))}
    with pytest.raises(dc.CheckpointingException, match="has no tensor 'nope'"):
        dc.load(missing, ckpt)
    out = dc.load(missing, ckpt, strict="ignore_all")
    assert "x" not in out  # Megatron drops the keys the checkpoint lacks from the load
    # Truncate the data file: the error names it instead of showing an unpickling traceback.
    data = [f for f in os.listdir(ckpt) if f.endswith(".distcp")][0]
    path = os.path.join(ckpt, data)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(dc.CheckpointingException, match=f"truncated or missing file.*{data}"):
        dc.load(_sharded_sd(0, 1, w, b), ckpt)
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(dc.CheckpointingException, match="corrupted checkpoint metadata file"):
        dc.load(_sharded_sd(0, 1, w, b), ckpt)


def test_allow_shape_mismatch_zero_pads_past_the_saved_shape(tmp_path):
    """Megatron zero-fills what the checkpoint does not cover; the buffer is garbage-filled first so
    an uninitialised read cannot pass by chance."""
    ckpt = str(tmp_path / "c")
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))}, ckpt)
    sh = ShardedTensor.from_rank_offsets("w", torch.full((4, 5), 3.7e19), allow_shape_mismatch=True)
    orig_empty = torch.empty

    def garbage_empty(*a, **k):  # float buffers only: DCP also allocates byte buffers for its own reads
        t = orig_empty(*a, **k)
        return t.fill_(3.7e19) if t.is_floating_point() else t

    try:
        torch.empty = garbage_empty
        out = dc.load({"w": sh}, ckpt)["w"]
    finally:
        torch.empty = orig_empty
    expected = torch.zeros(4, 5)
    expected[:2, :3] = 1
    assert torch.equal(out, expected)
    two_d = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3, 1), allow_shape_mismatch=True)
    with pytest.raises(dc.CheckpointingException, match=r"'w' has global shape \(2, 3\).*another number of dims"):
        dc.load({"w": two_d}, ckpt)


def _request(keys):
    return {k: ShardedTensor.from_rank_offsets(k, torch.zeros(2)) for k in keys}


@pytest.mark.parametrize("strict,missing,unexpected", [
    ("return_unexpected", set(), {"c"}),   # *_unexpected modes do not look for missing keys
    ("return_all", {"b"}, {"c"}),
])
def test_strict_return_modes_give_megatrons_tuple(tmp_path, strict, missing, unexpected):
    ckpt = str(tmp_path / "c")
    dc.save({k: ShardedTensor.from_rank_offsets(k, torch.full((2,), float(i))) for i, k in enumerate("ab")}, ckpt)
    result = dc.load(_request("ac"), ckpt, strict=dc.validation.StrictHandling(strict))
    assert isinstance(result, tuple) and len(result) == 3
    state, got_missing, got_unexpected = result
    assert (got_missing, got_unexpected) == (missing, unexpected)
    assert torch.equal(state["a"], torch.zeros(2)) and "c" not in state
    assert dc.load(_request("a"), ckpt, strict=strict)[1:] == (set() if strict == "return_unexpected" else {"b"}, set())


def test_strict_raise_and_log_modes(tmp_path, caplog):
    ckpt = str(tmp_path / "c")
    dc.save(_request("ab"), ckpt)
    with pytest.raises(dc.CheckpointingException, match=r"lacks \(unexpected, this rank\): \['c'\]"):
        dc.load(_request("ac"), ckpt, strict="raise_unexpected")
    assert set(dc.load(_request("a"), ckpt, strict="raise_unexpected")) == {"a"}
    with pytest.raises(dc.CheckpointingException, match=r"no rank requested \(missing\): \['b'\]"):
        dc.load(_request("a"), ckpt, strict="raise_all")
    out = dc.load(_request("ac"), ckpt, strict="log_all")
    assert set(out) == {"a"} and "missing): ['b']" in caplog.text and "['c']" in caplog.text


def test_load_content_metadata(tmp_path):
    ckpt = str(tmp_path / "c")
    meta = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
    dc.save(_request("a"), ckpt, content_metadata=meta)
    assert dc.load_content_metadata(ckpt) == meta
    loaded = dc.load(_request("a"), ckpt)
    assert dc.load_content_metadata(preloaded_state_dict=loaded) == meta  # load returns it, as Megatron's
    plain = str(tmp_path / "plain")
    dc.save(_request("a"), plain)
    assert dc.load_content_metadata(plain) is None
