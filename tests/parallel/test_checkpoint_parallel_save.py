"""Fully parallel torch_dist save at DP=2 with the distributed optimizer: no rank stages the whole optimizer
state (each holds and writes its own 1/DP range), the DP-replicated weights are written once but spread
over both ranks, every rank writes a file, and the checkpoint resumes bit for bit, also through the fully
parallel load (each replicated weight read by one rank and broadcast)."""
import os

import torch.distributed as dist

from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_checkpoint_reshard_gpt import DP2_DISTOPT, _build, _sharded, _step


def _state_bytes(tree) -> int:
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import iter_leaves
    return sum(v.data.numel() * v.data.element_size() for _, v in iter_leaves(tree) if isinstance(v, ShardedTensor))


def _save_and_resume(base):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import iter_leaves
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
        plan_parallel_reads,
    )
    from megatron.core.dist_checkpointing.strategies.staging import HostStaging

    model, opt = _build(**DP2_DISTOPT)
    for it in range(2):
        _step(model, opt, it)
    # The whole optimizer state: fp32 Adam moments (2 tensors) of every param, each param held whole.
    full_opt_bytes = 2 * 4 * sum(p.numel() for p in model.module.parameters())
    sd = _sharded(model, opt)
    staged_opt_bytes = _state_bytes(sd["optimizer"])
    out = {"full_opt_bytes": full_opt_bytes, "staged_opt_bytes": staged_opt_bytes}
    group = ps.get_data_parallel_group(with_context_parallel=True)
    for name, strategy in (("parallel", FullyParallelSaveStrategyWrapper(None, group)), ("rank0", None)):
        staging = HostStaging(pin=False, keep=False)  # an async save's host copy: what this rank stages
        request = dist_checkpointing.save(_sharded(model, opt), f"{base}/{name}", sharded_strategy=strategy,
                                          async_sharded_save=True, host_staging=staging)
        out[f"{name}_staged_bytes"] = staging.stats["bytes"]
        request.async_fn()
        for fn in request.finalize_fns:
            fn()
        dist.barrier()
        out[f"{name}_file_bytes"] = os.path.getsize(f"{base}/{name}/__{dist.get_rank()}_0.distcp")
    expected = [_step(model, opt, it) for it in (2, 3)]
    ps.destroy_model_parallel()
    model, opt = _build(**DP2_DISTOPT)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), f"{base}/parallel")
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    out["resumed_equal"] = [_step(model, opt, it) for it in (2, 3)] == expected
    ps.destroy_model_parallel()
    # Fully parallel load: each replicated weight is read by one DP rank and broadcast; same values.
    model, opt = _build(**DP2_DISTOPT)
    request = _sharded(model, opt, is_loading=True)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    tensors = [v for _, v in iter_leaves(request["model"]) if isinstance(v, ShardedTensor)]
    mine, _ = plan_parallel_reads(tensors, group)
    out["model_bytes"] = sum(t.data.numel() * t.data.element_size() for t in tensors)
    out["model_read_bytes"] = sum(tensors[i].data.numel() * tensors[i].data.element_size() for i in mine)
    loaded = dist_checkpointing.load(request, f"{base}/parallel",
                                     sharded_strategy=FullyParallelLoadStrategyWrapper(None, group))
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    out["parallel_load_equal"] = [_step(model, opt, it) for it in (2, 3)] == expected
    ps.destroy_model_parallel()
    return out


def test_each_dp_rank_stages_and_writes_its_share(tmp_path):
    r0, r1 = run_distributed(_save_and_resume, 2, str(tmp_path))
    full = r0["full_opt_bytes"]
    for r in (r0, r1):
        # Each rank's optimizer state in the save is its own range: half of the whole (bucket padding aside),
        # never the gathered full state.
        assert 0.4 * full <= r["staged_opt_bytes"] <= 0.6 * full, (r["staged_opt_bytes"], full)
        assert r["resumed_equal"] and r["parallel_load_equal"]
        # Fully parallel load: each rank reads about half of the (DP-replicated) weights, not all of them.
        assert 0.4 * r["model_bytes"] <= r["model_read_bytes"] <= 0.6 * r["model_bytes"], r
    assert r0["staged_opt_bytes"] + r1["staged_opt_bytes"] == full
    # Without the parallel save DP rank 0 stages and writes every weight; with it the two ranks share them.
    assert r0["rank0_staged_bytes"] > 1.5 * r1["rank0_staged_bytes"]
    total = r0["parallel_staged_bytes"] + r1["parallel_staged_bytes"]
    assert total == r0["rank0_staged_bytes"] + r1["rank0_staged_bytes"]  # each chunk written once either way
    for r in (r0, r1):
        assert 0.4 * total <= r["parallel_staged_bytes"] <= 0.6 * total, (r0, r1)
        assert r["parallel_file_bytes"] >= r["parallel_staged_bytes"]  # both ranks write their files
