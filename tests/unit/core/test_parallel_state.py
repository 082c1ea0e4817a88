"""Rank grid arithmetic (no processes) and the real groups on 4 spawned gloo ranks."""
import os

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from tests.parallel.dist_utils import run_distributed


def test_grid_16_ranks_tp2_pp2_dp4():
    g = RankGenerator(tp=2, ep=1, dp=4, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert g.get_ranks("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.get_ranks("pp") == [[i, i + 8] for i in range(8)]
    assert g.get_ranks("tp-pp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert g.get_ranks("tp-dp") == [list(range(8)), list(range(8, 16))]


def test_grid_other_order_and_cp():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert g.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert g.get_ranks("cp") == [[0, 2], [1, 3]]
    assert g.get_ranks("dp-cp") == [[0, 2], [1, 3]]


def test_grid_bad_order():
    with pytest.raises(ValueError, match="lacks 'pp'"):
        RankGenerator(tp=1, ep=1, dp=1, pp=2, cp=1, order="tp-dp")
    with pytest.raises(ValueError, match="unknown token"):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-xx")


def test_uninitialized_defaults():
    ps.destroy_model_parallel()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_tensor_model_parallel_group() is None
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_data_parallel_world_size() == 1 and ps.get_data_parallel_rank() == 0
    assert not ps.model_parallel_is_initialized()


def _groups_4():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo CPU test, also on GPU hosts with fewer GPUs than ranks
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=2)
    out = dict(
        tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        src=ps.get_tensor_model_parallel_src_rank(), next=ps.get_pipeline_model_parallel_next_rank(),
        prev=ps.get_pipeline_model_parallel_prev_rank(), first=ps.is_pipeline_first_stage(),
        last=ps.is_pipeline_last_stage(), last_v0=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0),
        last_v1=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1),
        emb=ps.is_rank_in_embedding_group(), mp=ps.get_model_parallel_world_size(),
        edp=ps.get_expert_data_parallel_world_size(),
    )
    # A real collective on the TP group proves the group is usable.
    t = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    out["tp_sum"] = t.item()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=3)
    except ValueError as e:
        out["err"] = str(e)
    return out


def test_groups_4_ranks():
    res = run_distributed(_groups_4, 4)
    assert [r["tp"] for r in res] == [0, 1, 0, 1]
    assert [r["pp"] for r in res] == [0, 0, 1, 1]
    assert [r["src"] for r in res] == [0, 0, 2, 2]
    assert [r["next"] for r in res] == [2, 3, 0, 1]
    assert [r["prev"] for r in res] == [2, 3, 0, 1]
    assert [r["tp_sum"] for r in res] == [1.0, 1.0, 5.0, 5.0]
    assert [r["first"] for r in res] == [True, True, False, False]
    assert [r["last_v1"] for r in res] == [False, False, True, True]
    assert not any(r["last_v0"] for r in res)
    assert all(r["dp_size"] == 1 and r["mp"] == 4 and r["emb"] and r["edp"] == 1 for r in res)
    assert "not divisible" in res[0]["err"]


def _gloo_twins(create):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    ps.initialize_model_parallel(create_gloo_process_groups=create)
    return ps.get_data_parallel_group_gloo() is not None, ps.get_expert_data_parallel_group_gloo() is not None


def test_disable_gloo_process_groups():
    """--disable-gloo-process-groups (create_gloo_process_groups=False): no gloo twins of the DP groups."""
    from megatron.training.arguments import parse_args
    assert parse_args(argv=["--disable-gloo-process-groups"]).use_gloo_process_groups is False
    assert parse_args(argv=[]).use_gloo_process_groups is True
    assert run_distributed(_gloo_twins, 2, False) == [(False, False)] * 2
    assert run_distributed(_gloo_twins, 2, True) == [(True, True)] * 2
